"""Turns the benchmark's raw results into ``docs/benchmarks.md`` (medians, the targets' ratios, the
machine) and PNG plots beside it. Used by :mod:`benchmarks.run`; also runnable on a saved JSON::

    python -m benchmarks.report docs/benchmarks.json docs/benchmarks.md

Figures live in the reports only; the README links them.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .fmt import GIB, MIB, num
from .scale_report import section_for

# What the report says about a store other than moto (whose line is in the machine paragraph).
STORE_TEXT = {
    "localbucket": "localbucket {version}: a small S3 server in a process of its own on 127.0.0.1, objects "
    "in files on local disk, sharing the cores with the client.",
}
# Hand-written reading of the figures (which targets hold, which do not and why), appended to the report.
NOTES = Path(__file__).with_name("report_notes.md")

# (label, target, how the ratio is computed) — see docs/benchmarks.md for the definitions.
TARGETS = (
    ("async_save blocked time vs an in-memory copy", "<= 1.5x"),
    ("time to .metadata: FileSystemWriter on s3fs / ours to S3", ">= 3x"),
    ("upload throughput vs raw boto3", ">= 0.85x"),
    ("download (load) throughput vs raw boto3", ">= 0.85x"),
    ("dcp.load: FileSystemReader on s3fs / ours from S3", ">= 3x"),
    ("peak extra memory of a save / checkpoint share", "<= 0.25"),
    ("vs s3torchconnector (save, load)", ">= 1x"),
)


#: The case that measures DCP's own floor for async_save's blocked time (benchmarks.clients.CopyOnlyWriter):
#: shown beside the in-memory copy, not as a save path of its own (it saves to local disk).
FLOOR_CASE = "dcp-floor"

NAIVE_S = ("naive_save_s", "naive_load_s")
NAIVE_CPU = ("naive_save_cpu_s", "naive_load_cpu_s")

# (state-dict kind, requested size in MiB, ranks, S3 store): one section of the report.
Combo = tuple[str, int, int, str]
#: The store of results that predate --stores.
DEFAULT_STORE = "moto"
# The S3 server's CPU per timed call, as the cases report it (every rank reads the same server).
STORE_CPU = (
    "sync_save_store_cpu_s",
    "load_store_cpu_s",
    "upload_store_cpu_s",
    "download_store_cpu_s",
    "naive_save_store_cpu_s",
    "naive_load_store_cpu_s",
)


#: Cores kept busy by one timed call, client and store together: (client CPU + store CPU) / wall
#: seconds, per run before the median. Near the host's core count, a call is CPU-bound: going
#: faster needs less CPU on one side or the other, not more overlap.
BUSY = {
    "sync_save_busy": ("sync_save_s", "sync_save_cpu_s", "sync_save_store_cpu_s"),
    "load_busy": ("load_s", "load_cpu_s", "load_store_cpu_s"),
    "naive_save_busy": ("naive_save_s", "naive_save_cpu_s", "naive_save_store_cpu_s"),
    "naive_load_busy": ("naive_load_s", "naive_load_cpu_s", "naive_load_store_cpu_s"),
    "upload_busy": ("upload_s", "upload_cpu_s", "upload_store_cpu_s"),
    "download_busy": ("download_s", "download_cpu_s", "download_store_cpu_s"),
}


def _run_rows(results: list[dict[str, Any]], default_mb: int) -> dict[tuple[Combo, str], list[dict[str, float]]]:
    """One row per run (all ranks folded: slowest rank's times, rank 0's publish time, the biggest
    process's memory), grouped by (combo, case). ``default_mb``: the size of results that predate
    per-kind sizes."""
    by_run: dict[tuple[Combo, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        combo = (r["kind"], r.get("size_mb", default_mb), r["ranks"], r.get("store", DEFAULT_STORE))
        by_run[(combo, r["name"], r["repeat"])].append(r)
    rows: dict[tuple[Combo, str], list[dict[str, float]]] = defaultdict(list)
    for (combo, name, _rep), rs in by_run.items():
        row: dict[str, float] = {
            "bytes": sum(r["rank_bytes"] for r in rs),
            "rank_bytes": max(r["rank_bytes"] for r in rs),
            "memcopy_s": max(r["memcopy_s"] for r in rs),
        }
        for key in ("sync_save_cpu_s", "load_cpu_s", "upload_cpu_s", "download_cpu_s", *NAIVE_CPU):
            vals = [r[key] for r in rs if key in r]
            if vals:
                row[key] = sum(vals)  # client CPU of every rank's process
        for key in (
            "blocked_s",
            "blocked_kept_s",
            "load_s",
            "upload_s",
            "download_s",
            "sync_save_s",
            "async_done_s",
            *NAIVE_S,
        ):
            vals = [r[key] for r in rs if key in r]
            if vals:
                row[key] = max(vals)
        # One server seen by every rank over about the same window: the largest figure, not a sum.
        for key in (
            "store_cpu_s",
            *STORE_CPU,
            "sync_peak_extra_bytes",
            "async_peak_extra_bytes",
            "load_peak_extra_bytes",
        ):
            vals = [r[key] for r in rs if key in r]
            if vals:
                row[key] = max(vals)
        pub = [r["publish_s"] for r in rs if "publish_s" in r]
        if pub:
            row["publish_s"] = pub[0]
        for busy, (wall, client, server) in BUSY.items():
            if wall in row and client in row and server in row and row[wall] > 0:
                row[busy] = (row[client] + row[server]) / row[wall]
        rows[(combo, name)].append(row)
    return rows


def medians(results: list[dict[str, Any]], default_mb: int = 256) -> dict[tuple[Combo, str], dict[str, float]]:
    """Median over repeats of every measure, per (combo, case)."""
    out = {}
    for key, rows in _run_rows(results, default_mb).items():
        fields = set().union(*rows)
        out[key] = {f: statistics.median(r[f] for r in rows if f in r) for f in fields}
        out[key]["n"] = len(rows)
    return out


def combo_memcopy(m: dict[tuple[Combo, str], dict[str, float]], combo: Combo) -> float | None:
    """The in-memory copy of the state dict (seconds, per rank) that blocked times are judged
    against: the median over the combo's cases of each case's median copy. Every case times the
    same copy in its own process, and one case's copy can come out cold (a first copy of a process
    once took 16x the others); judging a case against its own copy let such an outlier flatter or
    sink its blocked-time ratio. None when no case of the combo timed a copy."""
    copies = [row["memcopy_s"] for (c, _), row in m.items() if c == combo and "memcopy_s" in row]
    return statistics.median(copies) if copies else None


def target_ratios(
    m: dict[tuple[Combo, str], dict[str, float]], combo: Combo
) -> list[tuple[str, str, str, bool | None]]:
    """(target, wanted, measured, met) for one combo; measured is '-' when a case is missing."""

    def get(name: str) -> dict[str, float] | None:
        return m.get((combo, name))

    uc, fsfuse, raw, s3tc = get("uc-s3"), get("fs-s3fs"), get("boto3"), get("s3tc")
    rows: list[tuple[str, str, str, bool | None]] = []

    def add(i: int, value: float | None, good: bool | None, fmt: str = "{:.2f}x") -> None:
        label, want = TARGETS[i]
        rows.append((label, want, "-" if value is None else fmt.format(value), good if value is not None else None))

    copy = combo_memcopy(m, combo)
    v = uc["blocked_s"] / copy if uc and copy else None
    add(0, v, v is not None and v <= 1.5)
    v = fsfuse["publish_s"] / uc["publish_s"] if uc and fsfuse else None
    add(1, v, v is not None and v >= 3)
    v = raw["upload_s"] / (uc["publish_s"] - uc["blocked_s"]) if uc and raw else None
    add(2, v, v is not None and v >= 0.85)
    v = raw["download_s"] / uc["load_s"] if uc and raw else None
    add(3, v, v is not None and v >= 0.85)
    v = fsfuse["load_s"] / uc["load_s"] if uc and fsfuse else None
    add(4, v, v is not None and v >= 3)
    v = uc["sync_peak_extra_bytes"] / uc["rank_bytes"] if uc else None
    add(5, v, v is not None and v <= 0.25, "{:.3f}")
    if uc and s3tc:
        save, load = s3tc["publish_s"] / uc["publish_s"], s3tc["load_s"] / uc["load_s"]
        label, want = TARGETS[6]
        rows.append((label, want, f"{save:.2f}x, {load:.2f}x", save >= 1 and load >= 1))
    else:
        add(6, None, None)
    return rows


def cost_targets(m: dict[tuple[Combo, str], dict[str, float]], combo: Combo) -> list[tuple[str, str, str, bool | None]]:
    """(target, wanted, measured, met) of the client-cost targets (issue 16) for one combo: ours
    (uc-s3) against the naive staged path and raw boto3 on the same objects (the boto3 case) and
    s3torchconnector, all with synchronous saves, 1 rank; '-' where a case is missing."""
    uc, b, s3tc = m.get((combo, "uc-s3")), m.get((combo, "boto3")), m.get((combo, "s3tc"))
    rows: list[tuple[str, str, str, bool | None]] = []

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num is not None and den else None

    def add(label: str, want: str, value: float | None, ok: Callable[[float], bool]) -> None:
        # Judged as shown (two decimals): equal CPU figures must not fail "<= 1.0x" by float noise.
        rows.append(
            (label, want, "-" if value is None else f"{value:.2f}x", None if value is None else ok(round(value, 2)))
        )

    u, n = uc or {}, b or {}
    add(
        "async_save blocked time vs an in-memory copy (synchronous staging)",
        "<= 1.1x",
        ratio(u.get("blocked_s"), combo_memcopy(m, combo)),
        lambda v: v <= 1.1,
    )
    if "blocked_kept_s" in u:
        add(
            "the same, staging buffers kept between saves (Staging(reuse_buffers=True), 2nd save on)",
            "<= 1.1x",
            ratio(u.get("blocked_kept_s"), combo_memcopy(m, combo)),
            lambda v: v <= 1.1,
        )
    floor = m.get((combo, FLOOR_CASE))
    if floor:
        add(
            "the same vs DCP's floor (async_save with a writer whose stage() is only that copy)",
            "<= 1.1x",
            ratio(u.get("blocked_s"), floor.get("blocked_s")),
            lambda v: v <= 1.1,
        )
    add(
        "save client CPU vs the naive staged path",
        "<= 1.0x",
        ratio(u.get("sync_save_cpu_s"), n.get("naive_save_cpu_s")),
        lambda v: v <= 1.0,
    )
    if combo[1] <= 64:
        add(
            "sync save time vs the naive staged path (fixed per-save costs)",
            "<= 1.2x",
            ratio(u.get("sync_save_s"), n.get("naive_save_s")),
            lambda v: v <= 1.2,
        )
    else:
        add(
            "sync save speed vs the naive staged path (the overlap pays)",
            ">= 1.15x",
            ratio(n.get("naive_save_s"), u.get("sync_save_s")),
            lambda v: v >= 1.15,
        )
    add(
        "load speed vs raw boto3 download of the same objects",
        ">= 1.1x",
        ratio(n.get("download_s"), u.get("load_s")),
        lambda v: v >= 1.1,
    )
    add(
        "load client CPU vs raw boto3 download",
        "<= 1.0x",
        ratio(u.get("load_cpu_s"), n.get("download_cpu_s")),
        lambda v: v <= 1.0,
    )
    if s3tc:
        add(
            "save client CPU vs s3torchconnector (aim)",
            "<= 1.5x",
            ratio(u.get("sync_save_cpu_s"), s3tc.get("sync_save_cpu_s")),
            lambda v: v <= 1.5,
        )
        unsigned = m.get((combo, "uc-s3-unsigned"))
        if unsigned:
            add(
                "the same, both UNSIGNED-PAYLOAD (ours: the sign_payload=False option)",
                "<= 1.5x",
                ratio(unsigned.get("sync_save_cpu_s"), s3tc.get("sync_save_cpu_s")),
                lambda v: v <= 1.5,
            )
        add(
            "sync save speed vs s3torchconnector",
            ">= 1x",
            ratio(s3tc.get("sync_save_s"), u.get("sync_save_s")),
            lambda v: v >= 1.0,
        )
        add("load speed vs s3torchconnector", ">= 1x", ratio(s3tc.get("load_s"), u.get("load_s")), lambda v: v >= 1.0)
    return rows


def cpu_rows(m: dict[tuple[Combo, str], dict[str, float]], combo: Combo) -> list[tuple[str, ...]]:
    """(path, sync save s, save client CPU-s/GiB, save store CPU-s/GiB, save cores busy, load s, load
    client CPU-s/GiB, load store CPU-s/GiB, load cores busy) for one combo: every case that measured
    CPU, the naive staged path and raw boto3 on our files (from the boto3 case). Client CPU is per GiB
    of checkpoint, summed over the ranks' processes; store CPU is the S3 server's over the same calls;
    cores busy is :data:`BUSY`'s figure ("-" where not measured)."""

    def per_gib(row: dict[str, float], key: str) -> str:
        return num(row[key] / (row["bytes"] / GIB)) if key in row else "-"

    def busy(row: dict[str, float], key: str) -> str:
        return num(row.get(key))

    out: list[tuple[str, ...]] = []
    for (c, name), row in sorted(m.items(), key=lambda kv: kv[0][1]):
        if c != combo:
            continue
        if name == "boto3":
            if "naive_save_s" in row:
                out.append(
                    (
                        "naive staged: FileSystemWriter to local disk, then boto3",
                        num(row["naive_save_s"]),
                        per_gib(row, "naive_save_cpu_s"),
                        per_gib(row, "naive_save_store_cpu_s"),
                        busy(row, "naive_save_busy"),
                        num(row.get("naive_load_s")),
                        per_gib(row, "naive_load_cpu_s"),
                        per_gib(row, "naive_load_store_cpu_s"),
                        busy(row, "naive_load_busy"),
                    )
                )
            if "upload_cpu_s" in row:
                out.append(
                    (
                        "raw boto3 on our files (transfer only)",
                        num(row["upload_s"]),
                        per_gib(row, "upload_cpu_s"),
                        per_gib(row, "upload_store_cpu_s"),
                        busy(row, "upload_busy"),
                        num(row["download_s"]),
                        per_gib(row, "download_cpu_s"),
                        per_gib(row, "download_store_cpu_s"),
                        busy(row, "download_busy"),
                    )
                )
        elif "sync_save_cpu_s" in row and name != FLOOR_CASE:
            out.append(
                (
                    name,
                    num(row["sync_save_s"]),
                    per_gib(row, "sync_save_cpu_s"),
                    per_gib(row, "sync_save_store_cpu_s"),
                    busy(row, "sync_save_busy"),
                    num(row.get("load_s")),
                    per_gib(row, "load_cpu_s"),
                    per_gib(row, "load_store_cpu_s"),
                    busy(row, "load_busy"),
                )
            )
    return out


def _plot(m: dict[tuple[Combo, str], dict[str, float]], combo: Combo, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kind, _size_mb, ranks, store = combo
    names = [n for (c, n) in m if c == combo and n != "boto3"]
    if not names:
        return False
    measures = (
        ("blocked_s", "blocked in async_save"),
        ("publish_s", "until .metadata on the volume"),
        ("load_s", "dcp.load"),
    )
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(measures)
    for i, (key, label) in enumerate(measures):
        ax.bar(
            [x + i * width for x in range(len(names))], [m[(combo, n)].get(key, 0.0) for n in names], width, label=label
        )
    ax.set_xticks([x + width for x in range(len(names))], names, rotation=20)
    ax.set_ylabel("seconds (median)")
    size = m[(combo, names[0])]["bytes"] / MIB
    ax.set_title(f"{kind} state dict, {size:.0f} MiB, {ranks} rank{'s' if ranks > 1 else ''}, {store}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _calls_text(raw: dict[str, Any]) -> str:
    """How many times the cases ran each synchronous phase per process, where more than once
    (``benchmarks.case --calls``), in words for the report's header; "" otherwise."""
    by_size = sorted(
        {(r["size_mb"], int(r.get("sync_save_calls", r.get("naive_save_calls", 1)))) for r in raw["results"]}
    )
    several = [f"{mb} MiB" for mb, calls in by_size if calls > 1]
    if not several:
        return ""
    calls = max(calls for _mb, calls in by_size)
    return (
        f"; at {', '.join(several)} each case ran every synchronous save, load, upload and download "
        f"{calls} times in its process and kept the median (one such call lasts a tenth of a second), "
        "the async save once"
    )


def write_report(raw: dict[str, Any], path: Path) -> None:
    """Write the markdown report (and its plots under ``<path stem>/``)."""
    m = medians(raw["results"], raw["args"]["size_mb"])
    mach = raw["machine"]
    cores = mach.get("cores", "?")
    a = raw["args"]
    # The FUSE client's version only where a case ran through it.
    fuse_ran = any(r.get("name", "").endswith("-s3fs") for r in raw["results"])
    fuse = f", {mach['s3fs_fuse']}" if fuse_ran and mach.get("s3fs_fuse") else ""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `./scripts/bench.sh` (`python -m benchmarks.run`); do not edit by hand. Raw runs: "
        f"`{path.with_suffix('.json').name}`. Definitions and how to read this: the docstrings of "
        "`benchmarks/run.py` and `benchmarks/case.py`.",
        "",
        f"Machine: {mach['cpu']}, {mach['cores']} cores, {mach['memory_gib']} GiB, Linux {mach['kernel']}; "
        f"Python {mach['python']}, torch {mach['torch']}, boto3 {mach['boto3']}, moto {mach['moto']} (S3 server "
        f"on 127.0.0.1, objects up to 5 MiB in memory and larger ones in temporary files on local disk, sharing the cores with the client){fuse}. "
        f"Run {mach['date']}: state-dict kinds and requested sizes {', '.join(_kind_sizes(a))} (actual sizes "
        f"below), ranks {', '.join(map(str, a['ranks']))}, {a['repeats']} repeats (medians below){_calls_text(raw)}.",
        "",
    ]
    if raw.get("note"):
        lines += [raw["note"], ""]
    if raw.get("skipped_cases"):
        lines += [f"Not run (package does not import here): {', '.join(raw['skipped_cases'])}.", ""]
    if raw.get("store_note"):
        lines += [raw["store_note"] + ".", ""]
    # Each combo's sections together, moto's first (it also has the FUSE cases).
    combos = sorted({c for (c, _n) in m}, key=lambda c: (c[:3], c[3] != DEFAULT_STORE, c[3]))
    for combo in combos:
        kind, size_mb, ranks, store = combo
        lines += [f"## {kind}, {size_mb} MiB, {ranks} rank{'s' if ranks > 1 else ''}, {store} store", ""]
        if store != DEFAULT_STORE:
            text = STORE_TEXT.get(store, store).format(version=mach.get(store, ""))
            lines += [f"{text} Only the direct-S3 cases run on it.", ""]
        lines += [
            "| case | blocked s | to .metadata s | load s | sync-save peak extra MiB | async peak extra MiB | "
            "MB/s to .metadata | MB/s load |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (c, name), row in sorted(m.items(), key=lambda kv: kv[0][1]):
            if c != combo:
                continue
            size = row["bytes"]
            if name == "boto3":
                lines.append(
                    f"| boto3 (raw upload / download) | - | {num(row['upload_s'])} | {num(row['download_s'])} "
                    f"| - | - | {size / 1e6 / row['upload_s']:.0f} | {size / 1e6 / row['download_s']:.0f} |"
                )
                continue
            lines.append(
                f"| {name} | {num(row.get('blocked_s'), digits=3)} | {num(row.get('publish_s'))} | {num(row.get('load_s'))} "
                f"| {num(row.get('sync_peak_extra_bytes'), MIB, 0)} | {num(row.get('async_peak_extra_bytes'), MIB, 0)} "
                f"| {size / 1e6 / row['publish_s']:.0f} | {size / 1e6 / row['load_s']:.0f} |"
            )
        memcopy = combo_memcopy(m, combo) or float("nan")
        floor = m.get((combo, FLOOR_CASE))
        lines += [
            "",
            f"In-memory copy of the state dict (per rank): {memcopy:.3f} s. Checkpoint size: "
            f"{next(row['bytes'] for (c, _), row in m.items() if c == combo) / MIB:.0f} MiB."
            + (
                f" DCP's floor for the blocked time ({FLOOR_CASE}: async_save with a writer whose stage() "
                f"is only that copy, saving to local disk): {floor['blocked_s']:.3f} s, "
                f"{floor['blocked_s'] / memcopy:.2f}x that copy."
                if floor
                else ""
            ),
            "",
        ]
        lines += ["| target | wanted | measured | met |", "|---|---|---|---|"]
        for label, want, got, ok in target_ratios(m, combo) + (cost_targets(m, combo) if ranks == 1 else []):
            lines.append(f"| {label} | {want} | {got} | {'-' if ok is None else ('yes' if ok else 'NO')} |")
        cpu = cpu_rows(m, combo)
        if cpu:
            lines += [
                "",
                "Synchronous `dcp.save` then `dcp.load`, with the client's CPU (user + system seconds of "
                "every rank's process per GiB of checkpoint) and, apart, the S3 server's CPU over the same "
                f"calls (the {store} server's process, per GiB of checkpoint"
                + (
                    "; moto runs in the benchmark runner's process, which only waits meanwhile"
                    if store == "moto"
                    else ""
                )
                + "; 10 ms clock ticks, so small checkpoints read coarsely). *Cores busy*: client and "
                f"store CPU seconds over the call's wall seconds, of the host's {cores} cores; near "
                f"{cores}, the call is CPU-bound on this host:",
                "",
                "| path | save s | save CPU-s/GiB | save store CPU-s/GiB | save cores busy | load s "
                "| load CPU-s/GiB | load store CPU-s/GiB | load cores busy |",
                "|---|---|---|---|---|---|---|---|---|",
                *(f"| {' | '.join(r)} |" for r in cpu),
            ]
        suffix = "" if store == DEFAULT_STORE else f"-{store}"
        png = path.parent / path.stem / f"{kind}-{size_mb}mib-{ranks}rank{suffix}.png"
        if _plot(m, combo, png):
            alt = f"{kind}, {size_mb} MiB, {ranks} rank{'s' if ranks > 1 else ''}, {store}"
            lines += ["", f"![{alt}]({path.stem}/{png.name})"]
        lines.append("")
    notes = NOTES.read_text().strip() if NOTES.exists() else ""
    # The notes read one particular run's figures: attach them only to that run's report.
    tag = re.match(r"<!-- run: (.*?) -->", notes)
    if notes and tag and tag.group(1) == mach["date"]:
        lines += [notes[tag.end() :].strip(), ""]
    elif notes:
        lines += [
            f"(The hand-written reading in `benchmarks/report_notes.md` describes the run of "
            f"{tag.group(1) if tag else 'another date'}, not this one.)",
            "",
        ]
    # The scale benchmark's section (benchmarks/scale.py) survives a regeneration of this report.
    lines += section_for(path)
    for suffix, title, module in (
        ("profile", "Where the client CPU goes", "benchmarks.profile"),
        ("staging", "Staging for async_save against DCP's DefaultStager", "benchmarks.staging"),
    ):
        page = path.parent / f"{path.stem}-{suffix}.md"
        if page.exists():  # regenerated by its own command (scripts/bench.sh runs it)
            lines += [f"## {title}", "", f"[{page.name}]({page.name}) (`python -m {module}`).", ""]
    path.write_text("\n".join(lines))


def _kind_sizes(args: dict[str, Any]) -> list[str]:
    """The run's kinds with their sizes, as ``gpt:256`` (``--kinds`` entries without a size get --size-mb)."""
    return [k if ":" in k else f"{k}:{args['size_mb']}" for k in args["kinds"]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    raw = json.loads(Path(argv[0]).read_text())
    write_report(raw, Path(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
