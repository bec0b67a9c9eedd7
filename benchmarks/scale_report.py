"""The scale benchmark's report: each cost's growth derived from the measured points, the tables, the
plots, and the short "Scale" section of ``docs/benchmarks.md``. Used by :mod:`benchmarks.scale` and by
:func:`benchmarks.report.write_report` (which includes the section whenever ``scale.json`` exists,
so regenerating the main report keeps it); also runnable on a saved JSON::

    python -m benchmarks.scale_report docs/benchmarks/scale.json docs/benchmarks-scale.md docs/benchmarks.md
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fmt import GIB, MIB, point

BEGIN, END = "<!-- scale:begin -->", "<!-- scale:end -->"
#: How much steeper than its bound a cost may measure before it is flagged (timing noise on a shared
#: 2-core machine; request and file counts are exact).
TOLERANCE = 0.25
BOUNDS = {0: "constant", 1: "linear"}
#: Hand-written reading of one run's figures (why a flagged cost grows), appended to that run's report.
NOTES = Path(__file__).with_name("scale_notes.md")


@dataclass(frozen=True)
class Growth:
    """How ``y`` grows with ``x``: the log-log slope (``exponent``; 0 constant, 1 linear) between
    the two largest ``x`` (where growth shows: below, fixed costs hide it), its name, and the
    marginal cost (least-squares slope of ``y`` on ``x`` over the points above the smallest)."""

    exponent: float
    label: str
    slope: float


def _lsq(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def classify(exponent: float) -> str:
    if exponent < -TOLERANCE:
        return "falling"
    if exponent <= TOLERANCE:
        return "constant"
    if exponent < 1 - TOLERANCE:
        return "sublinear"
    if exponent <= 1 + TOLERANCE:
        return "linear"
    return "faster than linear"


def growth(xs: list[float], ys: list[float]) -> Growth:
    """The growth of ``ys`` over ``xs`` (at least two points with distinct positive ``x``).

    >>> growth([10, 100, 1000], [3, 3, 3]).label
    'constant'
    >>> growth([10, 100, 1000], [23, 203, 2003]).label, growth([10, 100, 1000], [23, 203, 2003]).slope
    ('linear', 2.0)
    """
    pts = sorted((float(x), float(y)) for x, y in zip(xs, ys) if x > 0)
    if len({x for x, _ in pts}) < 2:
        raise ValueError(f"growth needs two distinct x values, got {xs}")
    upper = pts[1:] if len(pts) >= 3 else pts
    ux, uy = [x for x, _ in upper], [y for _, y in upper]
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    top = max(abs(y0), abs(y1))
    if top == 0:
        return Growth(0.0, "constant", 0.0)
    # Counts may be 0 at a point (no HEAD at all): log-log needs a floor, far below the data.
    floor = top * 1e-3
    exponent = math.log(max(y1, floor) / max(y0, floor)) / math.log(x1 / x0)
    return Growth(exponent, classify(exponent), _lsq(ux, uy))


@dataclass(frozen=True)
class Series:
    """One cost of one sweep: its measured points, what it grows in, and the most it may grow
    (``bound``: 0 constant, 1 linear; None: shown, not judged)."""

    sweep: str
    cost: str
    x_name: str  # "ranks", "MiB", "tensors", "checkpoints"
    xs: list[float]
    ys: list[float]
    bound: int | None
    y_fmt: str = "{:.2f}"
    slope_unit: str = ""  # "s per GiB": shows the marginal cost, scaled by slope_scale
    slope_scale: float = 1.0
    # The store's own cost of the same work (raw boto3 doing it): a cost that grows no faster than
    # it is the store's limit showing, not the client's.
    reference: Series | None = None

    @property
    def growth(self) -> Growth:
        return growth(self.xs, self.ys)

    @property
    def store_bound(self) -> bool:
        """Steeper than its bound, but no steeper than the store's own cost of the same work."""
        return (
            self.bound is not None
            and self.growth.exponent > self.bound + TOLERANCE
            and self.reference is not None
            and self.reference.growth.exponent >= self.growth.exponent - TOLERANCE
        )

    @property
    def flagged(self) -> bool:
        return self.bound is not None and self.growth.exponent > self.bound + TOLERANCE and not self.store_bound

    def points(self) -> str:
        return ", ".join(f"{self.y_fmt.format(y)} at {point(x)}" for x, y in zip(self.xs, self.ys))

    def verdict(self) -> str:
        g = self.growth
        text = f"{g.label} in {self.x_name} (exponent {g.exponent:.2f}"
        if self.slope_unit:
            text += f"; {g.slope * self.slope_scale:+.3g} {self.slope_unit}"
        if self.store_bound and self.reference is not None:
            ref = self.reference.cost.split(" (")[0]
            text += f"; {ref} grows alike, exponent {self.reference.growth.exponent:.2f}"
        return text + ")"


def _rows(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return list(data.get(key) or [])


def series_of(data: dict[str, Any]) -> list[Series]:
    """Every judged and shown cost of a run, in report order (sweeps that did not run are left out)."""
    out: list[Series] = []
    ranks = _rows(data, "ranks")
    for name, label in (("total", "fixed total"), ("share", "fixed share per rank")):
        rows = [r for r in ranks if r["series"] == name]
        if len(rows) < 2:
            continue
        xs = [r["ranks"] for r in rows]
        amount = f"{rows[0]['size_mb']} MiB" if name == "total" else f"{rows[0]['share_bytes'] / MIB:.0f} MiB per rank"
        tag = f"{label}, {amount}"
        out += [
            Series("ranks", f"save to .metadata, s ({tag})", "ranks", xs, [_publish(r) for r in rows], 1),
            Series("ranks", f"load s ({tag})", "ranks", xs, [r["load_s"] for r in rows], 1),
            Series("ranks", f"data files per rank ({tag})", "ranks", xs, [r["files_max"] for r in rows],
                   0 if name == "share" else None, "{:.0f}"),
            Series("ranks", f"data objects in all ({tag})", "ranks", xs, [r["objects"] for r in rows], 1, "{:.0f}"),
            Series("ranks", f"requests of a save ({tag})", "ranks", xs,
                   [r["requests_save"]["total"] for r in rows], 1, "{:.0f}", "requests per rank"),
            Series("ranks", f"requests of a load ({tag})", "ranks", xs,
                   [r["requests_load"]["total"] for r in rows], 1, "{:.0f}", "requests per rank"),
        ]  # fmt: skip
        if all("load_ranged_bytes" in r for r in rows):
            out.append(
                Series("ranks", f"bytes a load fetches / checkpoint bytes ({tag})", "ranks", xs,
                       [_fetched(r) for r in rows], 0)
            )  # fmt: skip
    for store, sizes in _size_rows_by_store(data).items():
        if len(sizes) < 2:
            continue
        xs = [r["bytes"] / MIB for r in sizes]
        raw = (
            Series("size", f"raw boto3 download s of the same objects ({store}; the store, for reference)", "MiB",
                   xs, [r["raw_download_s"] for r in sizes], None, slope_unit="s per GiB", slope_scale=1024)
            if all("raw_download_s" in r for r in sizes)
            else None
        )  # fmt: skip
        out += [
            Series("size", f"save s ({store})", "MiB", xs, [r["save_s"] for r in sizes], 1,
                   slope_unit="s per GiB", slope_scale=1024),
            Series("size", f"load s ({store})", "MiB", xs, [r["load_s"] for r in sizes], 1,
                   slope_unit="s per GiB", slope_scale=1024, reference=raw),
            *([raw] if raw is not None else []),
            Series("size", f"save client CPU-s/GiB ({store})", "MiB", xs,
                   [_per_gib(r, "save_cpu_s") for r in sizes], 0),
        ]  # fmt: skip
        raw_cpu = (
            Series("size", f"raw boto3 download client CPU-s/GiB of the same objects ({store}; reference)", "MiB",
                   xs, [_per_gib(r, "raw_download_cpu_s") for r in sizes], None)
            if all("raw_download_cpu_s" in r for r in sizes)
            else None
        )  # fmt: skip
        # A client waiting on a store that slows down wakes up more per byte (more, smaller socket
        # reads): raw boto3 reading the same objects on the same store shows how much of that is
        # the store's.
        out.append(
            Series("size", f"load client CPU-s/GiB ({store})", "MiB", xs, [_per_gib(r, "load_cpu_s") for r in sizes],
                   0, reference=raw_cpu)
        )  # fmt: skip
        out += [raw_cpu] if raw_cpu is not None else []
    tensors = _rows(data, "tensors")
    if len(tensors) >= 2:
        xs = [r["tensors"] for r in tensors]
        out += [
            Series(
                "tensors",
                "save s",
                "tensors",
                xs,
                [r["save_s"] for r in tensors],
                1,
                slope_unit="us per tensor",
                slope_scale=1e6,
            ),
            Series(
                "tensors",
                "load s",
                "tensors",
                xs,
                [r["load_s"] for r in tensors],
                1,
                slope_unit="us per tensor",
                slope_scale=1e6,
            ),
        ]
        if all("fs_save_s" in r for r in tensors):
            out += [
                Series("tensors", "save s, DCP FileSystemWriter to local disk (reference)", "tensors", xs,
                       [r["fs_save_s"] for r in tensors], None, slope_unit="us per tensor", slope_scale=1e6),
                Series("tensors", "load s, DCP FileSystemReader from local disk (reference)", "tensors", xs,
                       [r["fs_load_s"] for r in tensors], None, slope_unit="us per tensor", slope_scale=1e6),
            ]  # fmt: skip
    ckpts = _rows(data, "checkpoints")
    if len(ckpts) >= 2:
        xs = [r["checkpoints"] for r in ckpts]
        for key, what, req_bound in (
            ("latest", "CheckpointManager.latest()", 0),
            ("list", "CheckpointManager.list()", 1),
            ("ls", "uc-checkpoint ls (list_root)", 1),
            ("gc", "gc --dry-run (collect_garbage)", 1),
            ("save", "a save's housekeeping (tiny save, all kept)", 0),
        ):
            out.append(
                Series("checkpoints", f"requests of {what}", "checkpoints", xs,
                       [r[f"{key}_requests"]["total"] for r in ckpts], req_bound, "{:.0f}", slope_unit="per checkpoint")
            )  # fmt: skip
            out.append(
                Series("checkpoints", f"seconds of {what}", "checkpoints", xs, [r[f"{key}_s"] for r in ckpts],
                       None if key in ("ls", "gc", "list") else 1, "{:.3f}", slope_unit="ms per checkpoint", slope_scale=1e3)
            )  # fmt: skip
        out.append(
            Series("checkpoints", "seconds of one LIST of one location (the store, for reference)", "checkpoints",
                   xs, [r["store_list_s"] for r in ckpts], None, "{:.4f}", slope_unit="ms per checkpoint", slope_scale=1e3)
        )  # fmt: skip
    return out


def _size_rows_by_store(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The size sweep's rows per store, in run order (rows of runs before the sweep named its store
    were moto's)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in _rows(data, "size"):
        out.setdefault(r.get("store", "moto"), []).append(r)
    return out


def _fetched(r: dict[str, Any]) -> float:
    """Bytes the load's ranged GETs asked for, per byte of checkpoint (1.0: each byte once)."""
    return float(r["load_ranged_bytes"]) / r["bytes"]


def _publish(r: dict[str, Any]) -> float:
    return float(r.get("publish_s", r["save_s"]))


def _per_gib(r: dict[str, Any], key: str) -> float:
    return float(r[key]) / (r["bytes"] / GIB)


def files_match(data: dict[str, Any]) -> list[str]:
    """Ranks-sweep points whose data files per rank differ from what the rank's own share gives
    (``auto_file_size`` of the share, plus at most the one small file a rank's small items get, see
    ``uc_checkpoint.dcp.serialize.file_queue``), as sentences; empty when all match."""
    out = []
    for r in _rows(data, "ranks"):
        counts = set(r.get("files_per_rank", {}).values())
        if counts and max(counts) not in (r["expected_files"], r["expected_files"] + 1):
            out.append(
                f"{r['ranks']} ranks, {r['size_mb']} MiB: {sorted(counts)} files per rank, "
                f"{r['expected_files']} expected from the {r['share_bytes'] / MIB:.0f} MiB share"
            )
    return out


def _reqs(c: dict[str, int]) -> str:
    parts = [f"{k} {v}" for k, v in c.items() if k != "total"]
    return f"{c['total']} ({', '.join(parts)})" if parts else str(c["total"])


def _within(s: Series) -> str:
    if s.bound is None:
        return "-"
    return "NO" if s.flagged else ("the store's limit" if s.store_bound else "yes")


def summary_table(series: list[Series]) -> list[str]:
    lines = ["| sweep | cost | measured | growth | bound | within |", "|---|---|---|---|---|---|"]
    for s in series:
        bound = "-" if s.bound is None else BOUNDS[s.bound]
        within = _within(s)
        lines.append(f"| {s.sweep} | {s.cost} | {s.points()} | {s.verdict()} | {bound} | {within} |")
    return lines


def findings(data: dict[str, Any], series: list[Series]) -> list[str]:
    """Sentences on what grows faster than it must (empty list: nothing)."""
    out = [
        f"{s.sweep}: {s.cost} grows {s.growth.label} (exponent {s.growth.exponent:.2f}), "
        f"bound {BOUNDS[s.bound or 0]}: {s.points()}"
        for s in series
        if s.flagged
    ]
    out += [f"ranks: data files per rank do not follow the rank's share: {m}" for m in files_match(data)]
    return out


def _machine(data: dict[str, Any]) -> str:
    m = data["machine"]
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']}; Python "
        f"{m['python']}, torch {m['torch']}, boto3 {m['boto3']}, moto {m['moto']}. Run {m['date']}"
        f"{', commit ' + m['commit'] if m.get('commit') else ''}{' (--quick grid)' if data.get('quick') else ''}, "
        f"{data.get('elapsed_s', 0):.0f} s; 1-minute load average {m.get('load_average', '-')} at the start, "
        f"{m.get('load_average_end', '-')} at the end (other work on the machine shows here)."
    )


def render(data: dict[str, Any], plots: dict[str, str]) -> str:
    """The scale report (markdown); ``plots``: sweep -> image path relative to the report."""
    series = series_of(data)
    grid = data["grid"]
    lines = [
        "# Scale: how each cost grows",
        "",
        "Generated by `python -m benchmarks.scale` (run by `./scripts/bench.sh`); do not edit by hand. Raw "
        "results: `benchmarks/scale.json`. How it measures: the docstring of `benchmarks/scale.py`.",
        "",
        _machine(data),
        "",
        "The S3 server is moto in its own process (objects up to 5 MiB in memory, larger ones in temporary files; restarted for every point, sharing the "
        "cores with the client; the size sweep also runs on localbucket, see there); client CPU is the user + system time of the ranks' processes. Requests are "
        "counted on the wire by the fault proxy. Growth is the log-log slope between the two largest "
        f"points (exponent 0: constant, 1: linear; within +/-{TOLERANCE} of a whole number it is named "
        "so), and a cost is flagged when it grows faster than its bound. Medians of "
        f"{grid['repeats']} repeat(s) per point (`--repeats`), the largest size once.",
        "",
        "## Growth of each cost",
        "",
        *summary_table(series),
        "",
    ]
    found = findings(data, series)
    lines += (
        ["**Grows faster than it must:**", "", *(f"- {f}" for f in found)]
        if found
        else ["Nothing measured grows faster than its bound."]
    )
    lines.append("")
    lines += _ranks_section(data, plots)
    lines += _size_section(data, plots)
    lines += _tensors_section(data, plots)
    lines += _checkpoints_section(data, plots)
    lines += _reshard_section(data)
    lines += _notes(data["machine"]["date"])
    return "\n".join(lines)


def _notes(date: str) -> list[str]:
    """The hand-written notes when they describe this run (their ``<!-- run: DATE -->`` tag)."""
    notes = NOTES.read_text().strip() if NOTES.exists() else ""
    tag = re.match(r"<!-- run: (.*?) -->", notes)
    if not notes:
        return []
    if tag and tag.group(1) == date:
        return [notes[tag.end() :].strip(), ""]
    return [
        f"(The hand-written reading in `benchmarks/scale_notes.md` describes the run of "
        f"{tag.group(1) if tag else 'another date'}, not this one.)",
        "",
    ]


def _img(plots: dict[str, str], sweep: str) -> list[str]:
    return [f"![{sweep}]({plots[sweep]})", ""] if sweep in plots else []


def _ranks_section(data: dict[str, Any], plots: dict[str, str]) -> list[str]:
    rows = _rows(data, "ranks")
    if not rows:
        return []
    lines = [
        "## Ranks",
        "",
        "gpt state (model + AdamW, DTensor Shard(0) over a 1-D CPU mesh, gloo), one torchrun job per point. "
        "`fixed total`: the same checkpoint cut into more, smaller shares; `fixed share`: every rank saves "
        "the same bytes. Files per rank must follow the rank's own share (16 files of 16-256 MiB each, "
        "at least 16 MiB; `expected`), never the world size, plus one small file where a rank has small "
        "items (the step, optimizer scalars; `UCSavePlanner` puts the replicated ones on rank 0). "
        "`load fetched / size`: the bytes the load's ranged GETs "
        "asked for (Range headers, all ranks) per byte of checkpoint.",
        "",
        "| series | ranks | total MiB | share MiB | save to .metadata s | load s | files per rank | "
        "expected | objects | save requests | load requests | load fetched / size |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        files = sorted(set(r["files_per_rank"].values()))
        lines.append(
            f"| {r['series']} | {r['ranks']:.0f} | {r['bytes'] / MIB:.0f} | {r['share_bytes'] / MIB:.0f} | "
            f"{_publish(r):.2f} | {r['load_s']:.2f} | {'-'.join(map(str, files))} | {r['expected_files']} | "
            f"{r['objects']:.0f} | {_reqs(r['requests_save'])} | {_reqs(r['requests_load'])} | "
            f"{_fetched(r) if 'load_ranged_bytes' in r else float('nan'):.2f} |"
        )
    return [*lines, "", *_img(plots, "ranks")]


def _size_section(data: dict[str, Any], plots: dict[str, str]) -> list[str]:
    rows = _rows(data, "size")
    if not rows:
        return []
    lines = [
        "## Checkpoint size",
        "",
        "gpt state on 1 rank, synchronous `dcp.save` then `dcp.load` into zeros, directly to the store; then "
        "boto3's `download_fileobj` of the same data objects (4 at a time, our part size and concurrency): "
        "the store's own pace at that size. moto reads a whole object for every ranged GET, holding a lock "
        "per object meanwhile, so its load times grow with the size of the objects as well as with the bytes "
        "read (data files grow to 256 MiB with the checkpoint); localbucket (objects in files on local disk, "
        "in a process of its own) reads only the bytes asked for, so its rows show the client's own growth.",
        "",
        "| store | size MiB | save s | save MB/s | save CPU-s/GiB | load s | load MB/s | load CPU-s/GiB | "
        "raw boto3 download s | store peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rss = r.get("store_peak_rss_mib")
        lines.append(
            f"| {r.get('store', 'moto')} | {r['bytes'] / MIB:.0f} | {r['save_s']:.2f} | "
            f"{r['bytes'] / 1e6 / r['save_s']:.0f} | "
            f"{_per_gib(r, 'save_cpu_s'):.2f} | {r['load_s']:.2f} | {r['bytes'] / 1e6 / r['load_s']:.0f} | "
            f"{_per_gib(r, 'load_cpu_s'):.2f} | {r['raw_download_s'] if 'raw_download_s' in r else float('nan'):.2f} | "
            f"{'-' if rss is None else f'{rss:.0f}'} |"
        )
    return [*lines, "", *_img(plots, "size")]


def _tensors_section(data: dict[str, Any], plots: dict[str, str]) -> list[str]:
    rows = _rows(data, "tensors")
    if not rows:
        return []
    total = data["grid"]["tensors_total_mb"]
    lines = [
        "## Number of tensors",
        "",
        f"{total} MiB in all, as N float32 tensors of equal size under one `model` key, 1 rank: ours to the "
        "store, and DCP's stock FileSystemWriter/Reader on local disk (no network) for reference.",
        "",
        "| tensors | save s | save us/tensor | load s | load us/tensor | FileSystemWriter s | FileSystemReader s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["tensors"]
        fs = (f"{r['fs_save_s']:.2f}", f"{r['fs_load_s']:.2f}") if "fs_save_s" in r else ("-", "-")
        lines.append(
            f"| {n:,} | {r['save_s']:.2f} | {r['save_s'] / n * 1e6:.0f} | {r['load_s']:.2f} | "
            f"{r['load_s'] / n * 1e6:.0f} | {fs[0]} | {fs[1]} |"
        )
    return [*lines, "", *_img(plots, "tensors")]


def _checkpoints_section(data: dict[str, Any], plots: dict[str, str]) -> list[str]:
    rows = _rows(data, "checkpoints")
    if not rows:
        return []
    lines = [
        "## Checkpoints under one root",
        "",
        "One real save of a tiny state, its objects copied server-side to N step locations; every call "
        "through the counting proxy. `ls` and `gc` must visit each checkpoint (one listing of its location "
        "and one read of its `.metadata`); `latest()` and a save's housekeeping must not. moto answers a "
        "LIST by scanning every key of the bucket, so its LIST itself slows as checkpoints are added "
        "(last row of the summary); the time of `ls` and `gc` carries that, the request counts do not.",
        "",
        "| checkpoints | latest() s | latest() requests | list() s | list() requests | ls s | ls requests | "
        "gc --dry-run s | gc requests | save s | save requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{r['checkpoints']:,}"]
        for key in ("latest", "list", "ls", "gc", "save"):
            cells += [f"{r[f'{key}_s']:.3f}", _reqs(r[f"{key}_requests"])]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, "", *_img(plots, "checkpoints")]


def _reshard_section(data: dict[str, Any]) -> list[str]:
    r = data.get("reshard")
    if not r:
        return []
    s, l_ = r["saved_ranks"], r["loaded_ranks"]
    return [
        "## Resharding load",
        "",
        f"A {r['bytes'] / MIB:.0f} MiB gpt checkpoint saved by {s} ranks ({r.get('objects')} data objects), "
        f"loaded by {s} ranks and by {l_} (torchrun, gloo on the CPU); every tensor of each load compared with "
        "the saved content.",
        "",
        "| step | ranks | s | client CPU-s | requests | fetched / size |",
        "|---|---|---|---|---|---|",
        f"| save | {s} | {r['save_s']:.2f} | {r['save_cpu_s']:.2f} | {_reqs(r['save_requests'])} | - |",
        f"| load, same world size | {s} | {r['load_same_s']:.2f} | {r['load_same_cpu_s']:.2f} | "
        f"{_reqs(r['load_same_requests'])} | {_ratio(r, 'load_same_ranged_bytes')} |",
        f"| load, resharded | {l_} | {r['load_s']:.2f} | {r['load_cpu_s']:.2f} | {_reqs(r['load_requests'])} | "
        f"{_ratio(r, 'load_ranged_bytes')} |",
        "",
    ]


def _ratio(r: dict[str, Any], key: str) -> str:
    return f"{r[key] / r['bytes']:.2f}" if key in r else "-"


# -- plots ------------------------------------------------------------------------------------------


def _axis(s: Series) -> str:
    """What a cost's y axis holds: a count, a ratio of bytes, client CPU per GiB, or seconds."""
    if s.cost.startswith(("requests", "data files", "data objects")):
        return "count"
    if s.cost.startswith("bytes"):
        return "bytes per byte of checkpoint"
    return "CPU-s/GiB" if "CPU" in s.cost else "seconds"


def write_plots(data: dict[str, Any], plots_dir: Path, rel_to: Path) -> dict[str, str]:
    """One PNG per sweep (log-log), ``scale-<sweep>.png`` in ``plots_dir``; returns sweep -> path
    relative to ``rel_to`` (empty without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    by_sweep: dict[str, list[Series]] = {}
    for s in series_of(data):
        by_sweep.setdefault(s.sweep, []).append(s)
    out = {}
    for sweep, group in by_sweep.items():
        # Panels by what the y axis holds, so seconds and counts never share an axis.
        panels: dict[str, list[Series]] = {}
        for s in group:
            panels.setdefault(_axis(s), []).append(s)
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
        for ax, (ylabel, members) in zip(axes[0], panels.items()):
            for s in members:
                ax.plot(s.xs, [max(y, 1e-4) for y in s.ys], marker="o", label=f"{s.cost} [{s.growth.label}]")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(group[0].x_name)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"scale: {sweep}")
        fig.tight_layout()
        path = plots_dir / f"scale-{sweep}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        # relative whatever the two folders: a report written outside docs/ still finds its plots
        out[sweep] = Path(os.path.relpath(path.resolve(), rel_to.resolve())).as_posix()
    return out


# -- files -------------------------------------------------------------------------------------------


def write_scale_report(data: dict[str, Any], report: Path, plots_dir: Path) -> None:
    """The scale report at ``report`` and its plots in ``plots_dir``."""
    plots = write_plots(data, plots_dir, report.parent)
    report.write_text(render(data, plots) + "\n")


def main_report_block(data: dict[str, Any], scale_report: str) -> list[str]:
    """The "Scale" section of ``docs/benchmarks.md``, between markers; ``scale_report``: the path of
    the scale report relative to it."""
    series = series_of(data)
    found = findings(data, series)
    judged = [s for s in series if s.bound is not None]
    lines = [
        BEGIN,
        "## Scale",
        "",
        f"How each cost grows, from `python -m benchmarks.scale` (run {data['machine']['date']}"
        f"{', --quick grid' if data.get('quick') else ''}): {len(judged) - sum(s.flagged for s in judged)} of "
        f"{len(judged)} judged costs within their bound. Tables, plots and the method: "
        f"[{Path(scale_report).name}]({scale_report}).",
        "",
        "| sweep | cost | growth | within |",
        "|---|---|---|---|",
        *(f"| {s.sweep} | {s.cost} | {s.verdict()} | {_within(s)} |" for s in judged),
        "",
    ]
    if found:
        lines += ["Grows faster than it must:", "", *(f"- {f}" for f in found), ""]
    return [*lines, END]


def section_for(main_report: Path) -> list[str]:
    """The Scale block for ``main_report`` when its ``scale.json`` (in ``<stem>/``) exists, else []."""
    raw = main_report.parent / main_report.stem / "scale.json"
    if not raw.exists():
        return []
    return [*main_report_block(json.loads(raw.read_text()), f"{main_report.stem}-scale.md"), ""]


def splice(text: str, block: list[str]) -> str:
    """``text`` with its Scale block replaced by ``block`` (appended when it has none)."""
    new = "\n".join(block)
    start, end = text.find(BEGIN), text.find(END)
    if start >= 0 and end > start:
        return text[:start] + new + text[end + len(END) :]
    return text.rstrip("\n") + "\n\n" + new + "\n"


def update_main_report(main_report: Path, data: dict[str, Any], scale_report: Path) -> None:
    """Put the Scale block into ``main_report`` (created with just that block when missing)."""
    rel = Path(os.path.relpath(scale_report.resolve(), main_report.parent.resolve())).as_posix()
    text = main_report.read_text() if main_report.exists() else "# Benchmarks\n"
    main_report.write_text(splice(text, main_report_block(data, str(rel))))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    data = json.loads(Path(argv[0]).read_text())
    report = Path(argv[1])
    write_scale_report(data, report, Path(argv[0]).parent)
    if len(argv) > 2:
        update_main_report(Path(argv[2]), data, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
