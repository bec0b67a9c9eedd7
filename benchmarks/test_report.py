"""The report's arithmetic: medians per (kind, size, ranks, store), the target ratios, client and store
CPU, the --kinds and --stores choices, medians over a case's calls, and where a narrowed run's report
goes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fmt import MIB
from benchmarks.report import (
    cost_targets,
    cpu_rows,
    medians,
    target_ratios,
    write_report,
)
from benchmarks.run import _pick_stores, narrower_run, parse_kind


def _result(name: str, repeat: int, size_mb: int, **measures: float) -> dict:
    return {
        "kind": "gpt",
        "ranks": 1,
        "rank": 0,
        "name": name,
        "repeat": repeat,
        "size_mb": size_mb,
        "rank_bytes": size_mb * MIB,
        "memcopy_s": 0.1,
        **measures,
    }


def _run(size_mb: int, scale: float) -> list[dict]:
    out = []
    for rep, jitter in enumerate((1.0, 1.5, 0.9)):  # medians must ignore the outlying repeat
        out += [
            _result(
                "uc-s3",
                rep,
                size_mb,
                blocked_s=0.12 * jitter,
                publish_s=1.0 * scale * jitter,
                load_s=0.5 * scale,
                sync_peak_extra_bytes=0.1 * size_mb * MIB,
            ),
            _result("fs-s3fs", rep, size_mb, blocked_s=0.1, publish_s=3.5 * scale, load_s=1.0 * scale),
            _result("boto3", rep, size_mb, upload_s=0.8 * scale, download_s=0.6 * scale),
        ]
    return out


def test_ratios_are_medians_per_size(tmp_path: Path) -> None:
    results = _run(256, 1.0) + _run(1024, 4.0)
    m = medians(results)
    # Results without a store (runs before --stores) are moto's.
    assert {c for c, _ in m} == {("gpt", 256, 1, "moto"), ("gpt", 1024, 1, "moto")}
    assert m[(("gpt", 256, 1, "moto"), "uc-s3")]["publish_s"] == pytest.approx(1.0)  # median of 1.0, 1.5, 0.9
    rows = {label: (got, ok) for label, _want, got, ok in target_ratios(m, ("gpt", 1024, 1, "moto"))}
    assert rows["async_save blocked time vs an in-memory copy"] == ("1.20x", True)
    assert rows["time to .metadata: FileSystemWriter on s3fs / ours to S3"] == ("3.50x", True)
    # upload: raw 3.2 s against ours 4.0 - 0.12 s after the blocked part
    assert rows["upload throughput vs raw boto3"] == (f"{3.2 / (4.0 - 0.12):.2f}x", False)
    assert rows["dcp.load: FileSystemReader on s3fs / ours from S3"] == ("2.00x", False)
    assert rows["peak extra memory of a save / checkpoint share"] == ("0.100", True)
    assert rows["vs s3torchconnector (save, load)"] == ("-", None)

    report = tmp_path / "bench.md"
    raw = {
        "machine": {
            "date": "D",
            "cpu": "c",
            "cores": 2,
            "memory_gib": 1,
            "kernel": "k",
            "python": "p",
            "torch": "t",
            "boto3": "b",
            "moto": "m",
            "s3fs_fuse": "s3fs-fuse 9.9",
        },
        "args": {"size_mb": 256, "kinds": ["gpt:256", "gpt:1024"], "ranks": [1], "repeats": 3},
        "results": results,
    }
    write_report(raw, report)
    text = report.read_text()
    assert "## gpt, 256 MiB, 1 rank, moto store" in text and "## gpt, 1024 MiB, 1 rank, moto store" in text
    assert "requested sizes gpt:256, gpt:1024" in text
    assert "with the client), s3fs-fuse 9.9. Run" in text  # fs-s3fs ran: its FUSE client is named
    raw["results"] = [r for r in results if not r["name"].endswith("-s3fs")]
    write_report(raw, report)
    assert "s3fs-fuse 9.9" not in report.read_text() and "with the client). Run" in report.read_text()


def test_kind_specs() -> None:
    assert parse_kind("gpt", 256) == ("gpt", 256)
    assert parse_kind("small:64", 256) == ("small", 64)
    for bad in ("big", "gpt:", "gpt:0", "gpt:1.5", "gpt:-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="--kinds"):
            parse_kind(bad, 256)


def _cpu_results(store: str, store_cpu: float) -> list[dict]:
    """Two ranks of 128 MiB each (256 MiB in all) of uc-s3 and boto3 on ``store``."""
    results = []
    for rank in (0, 1):
        base = {
            "kind": "gpt",
            "size_mb": 256,
            "ranks": 2,
            "repeat": 0,
            "rank_bytes": 128 * MIB,
            "memcopy_s": 0.1,
            "store": store,
            "store_cpu_s": 3.0 * store_cpu,
        }
        results.append(
            {
                **base,
                "name": "uc-s3",
                "sync_save_s": 1.0 + rank,
                "sync_save_cpu_s": 0.5,
                # every rank reads the same server: the report takes the largest, not the sum
                "sync_save_store_cpu_s": store_cpu + 0.25 * rank,
                "load_s": 0.5,
                "load_cpu_s": 0.25,
                "load_store_cpu_s": store_cpu / 2,
            }
        )
        results.append(
            {
                **base,
                "name": "boto3",
                "upload_s": 0.8,
                "download_s": 0.6,
                "upload_cpu_s": 0.125,
                "download_cpu_s": 0.125,
                "upload_store_cpu_s": store_cpu,
                "download_store_cpu_s": store_cpu / 4,
                "naive_save_s": 2.0,
                "naive_save_cpu_s": 1.0,
                "naive_load_s": 1.5,
                "naive_load_cpu_s": 0.5,
            }
        )
    return results


def test_cpu_rows_are_per_gib_summed_over_ranks() -> None:
    # Client CPU seconds add up over the ranks' processes; the store's is one server's (the max).
    m = medians(_cpu_results("moto", 0.5) + _cpu_results("localbucket", 0.25))
    rows = {r[0]: r[1:] for r in cpu_rows(m, ("gpt", 256, 2, "moto"))}
    # 0.25 GiB in all: uc 1.0 CPU-s of save -> 4.00 per GiB; the slowest rank's time; store 0.75 s
    # (rank 1's 0.5 + 0.25) -> 3.00 per GiB; cores busy (1.0 + 0.75) / 2.0 s = 0.88, the load's
    # (0.5 + 0.25) / 0.5 s = 1.50.
    assert rows["uc-s3"] == ("2.00", "4.00", "3.00", "0.88", "0.50", "2.00", "1.00", "1.50")
    # no store CPU measured for the naive path here: "-", and no cores-busy figure either
    assert rows["naive staged: FileSystemWriter to local disk, then boto3"] == (
        "2.00",
        "8.00",
        "-",
        "-",
        "1.50",
        "4.00",
        "-",
        "-",
    )
    raw = ("0.80", "1.00", "2.00", "0.94", "0.60", "1.00", "0.50", "0.62")
    assert rows["raw boto3 on our files (transfer only)"] == raw
    lb = {r[0]: r[1:] for r in cpu_rows(m, ("gpt", 256, 2, "localbucket"))}
    assert lb["uc-s3"] == ("2.00", "4.00", "2.00", "0.75", "0.50", "2.00", "0.50", "1.25")
    assert m[(("gpt", 256, 2, "localbucket"), "uc-s3")]["store_cpu_s"] == pytest.approx(0.75)


def test_report_has_a_section_per_store(tmp_path: Path) -> None:
    results = _cpu_results("moto", 0.5) + _cpu_results("localbucket", 0.25)
    for r in results:
        r.update(blocked_s=0.1, publish_s=1.0, sync_peak_extra_bytes=MIB)
    raw = {
        "machine": {
            "date": "D",
            "cpu": "c",
            "cores": 2,
            "memory_gib": 1,
            "kernel": "k",
            "python": "p",
            "torch": "t",
            "boto3": "b",
            "moto": "m",
            "s3fs_fuse": "s",
            "localbucket": "9.9",
        },
        "args": {"size_mb": 256, "kinds": ["gpt"], "ranks": [2], "repeats": 1, "stores": ["moto", "localbucket"]},
        "results": results,
    }
    report = tmp_path / "bench.md"
    write_report(raw, report)
    text = report.read_text()
    moto_at = text.index("## gpt, 256 MiB, 2 ranks, moto store")
    lb_at = text.index("## gpt, 256 MiB, 2 ranks, localbucket store")
    assert moto_at < lb_at  # moto's section first
    assert "localbucket 9.9: a small S3 server" in text[lb_at:]
    # the headline rows once per store, each with its store's CPU
    assert text.count("| uc-s3 | 2.00 | 4.00 | 3.00 | 0.88 | 0.50 | 2.00 | 1.00 | 1.50 |") == 1
    assert text.count("| uc-s3 | 2.00 | 4.00 | 2.00 | 0.75 | 0.50 | 2.00 | 0.50 | 1.25 |") == 1
    assert text.index("| uc-s3 | 2.00 | 4.00 | 2.00 |") > lb_at > text.index("| uc-s3 | 2.00 | 4.00 | 3.00 |")
    assert text.count("| boto3 (raw upload / download) |") == 2
    assert "| save store CPU-s/GiB | save cores busy |" in text
    assert "of the host's 2 cores" in text


def test_store_choice() -> None:
    def works() -> None:
        return None

    def broken() -> str:
        return "ModuleNotFoundError: No module named 'localbucket'"

    assert _pick_stores(None, works) == (["moto", "localbucket"], "")
    stores, note = _pick_stores(None, broken)
    assert stores == ["moto"] and "No module named 'localbucket'" in note
    assert _pick_stores(["moto"], broken) == (["moto"], "")  # not asked for: not probed
    assert _pick_stores(["localbucket"], works) == (["localbucket"], "")
    with pytest.raises(SystemExit, match="cannot run here"):
        _pick_stores(["moto", "localbucket"], broken)


def _costs(size_mb: int, uc_save: float, naive_save: float) -> list[dict]:
    gib = size_mb / 1024
    out = []
    for rep in range(3):
        out += [
            _result(
                "uc-s3",
                rep,
                size_mb,
                blocked_s=0.1,
                publish_s=uc_save,
                sync_save_s=uc_save,
                sync_save_cpu_s=3.0 * gib,
                load_s=0.5,
                load_cpu_s=2.0 * gib,
            ),
            _result(
                "boto3",
                rep,
                size_mb,
                upload_s=0.7,
                download_s=0.6,
                upload_cpu_s=1.8 * gib,
                download_cpu_s=1.6 * gib,
                naive_save_s=naive_save,
                naive_save_cpu_s=3.2 * gib,
            ),
            _result(
                "s3tc",
                rep,
                size_mb,
                blocked_s=0.1,
                publish_s=2.0,
                sync_save_s=2.0,
                sync_save_cpu_s=2.5 * gib,
                load_s=1.5,
            ),
        ]
    return out


def test_cost_targets_follow_the_issues_rules_by_size() -> None:
    m = medians(_costs(256, uc_save=0.8, naive_save=1.0) + _costs(32, uc_save=0.3, naive_save=0.2))
    big = {label: (want, got, ok) for label, want, got, ok in cost_targets(m, ("gpt", 256, 1, "moto"))}
    assert big["save client CPU vs the naive staged path"] == ("<= 1.0x", "0.94x", True)
    assert big["sync save speed vs the naive staged path (the overlap pays)"] == (">= 1.15x", "1.25x", True)
    assert big["load speed vs raw boto3 download of the same objects"] == (">= 1.1x", "1.20x", True)
    assert big["load client CPU vs raw boto3 download"] == ("<= 1.0x", "1.25x", False)
    assert big["save client CPU vs s3torchconnector (aim)"] == ("<= 1.5x", "1.20x", True)
    assert big["load speed vs s3torchconnector"] == (">= 1x", "3.00x", True)
    assert not any("UNSIGNED-PAYLOAD" in label for label in big)  # that option was not run here
    small = {label: (got, ok) for label, _w, got, ok in cost_targets(m, ("gpt", 32, 1, "moto"))}
    # A small save is judged by its fixed costs: at most 1.2x the naive path's time.
    assert small["sync save time vs the naive staged path (fixed per-save costs)"] == ("1.50x", False)


@pytest.mark.parametrize(("blocked_s", "shown", "met"), [(0.11, "1.10x", True), (0.146, "1.46x", False)])
def test_cost_targets_judge_the_async_blocked_time_by_issue_16s_bound(blocked_s: float, shown: str, met: bool) -> None:
    # The older targets table keeps its 1.5x bound; issue 16 asks for 1.1x the in-memory copy.
    m = medians(_costs(32, uc_save=0.3, naive_save=0.2))
    combo = ("gpt", 32, 1, "moto")
    m[(combo, "uc-s3")]["blocked_s"] = blocked_s  # memcopy_s: 0.1
    rows = {label: (want, got, ok) for label, want, got, ok in cost_targets(m, combo)}
    assert rows["async_save blocked time vs an in-memory copy (synchronous staging)"] == ("<= 1.1x", shown, met)


def test_the_async_blocked_time_is_set_beside_dcps_floor(tmp_path: Path) -> None:
    # dcp-floor: DCP's async_save with a writer whose stage() is only the copy (0.1 s here).
    floor = [
        _result("dcp-floor", rep, 32, blocked_s=b, publish_s=0.2, sync_save_s=0.2, sync_save_cpu_s=0.1, load_s=0.1)
        for rep, b in enumerate((0.12, 0.15, 0.13))
    ]
    m = medians(_costs(32, uc_save=0.3, naive_save=0.2) + floor)
    combo = ("gpt", 32, 1, "moto")
    m[(combo, "uc-s3")]["blocked_s"] = 0.14
    rows = {label: (want, got, ok) for label, want, got, ok in cost_targets(m, combo)}
    label = "the same vs DCP's floor (async_save with a writer whose stage() is only that copy)"
    assert rows[label] == ("<= 1.1x", "1.08x", True)  # 0.14 against the floor's median 0.13
    assert rows["async_save blocked time vs an in-memory copy (synchronous staging)"] == ("<= 1.1x", "1.40x", False)
    # a local save: not a row of the CPU table, whose paths all talk to the store
    assert [r[0] for r in cpu_rows(m, combo)] == [
        "naive staged: FileSystemWriter to local disk, then boto3",
        "raw boto3 on our files (transfer only)",
        "s3tc",
        "uc-s3",
    ]
    # without the floor case (older runs) there is no such row
    assert label not in {r[0] for r in cost_targets(medians(_costs(32, uc_save=0.3, naive_save=0.2)), combo)}
    raw = {
        "machine": {
            k: "x" for k in ("date", "cpu", "memory_gib", "kernel", "python", "torch", "boto3", "moto", "s3fs_fuse")
        }
        | {"cores": 2},
        "args": {"size_mb": 32, "kinds": ["gpt"], "ranks": [1], "repeats": 3},
        "results": _costs(32, uc_save=0.3, naive_save=0.2) + floor,
    }
    for r in raw["results"]:
        r.setdefault("sync_peak_extra_bytes", MIB)
        r.setdefault("publish_s", 0.5)
        r.setdefault("load_s", 0.5)
    write_report(raw, tmp_path / "bench.md")
    assert "DCP's floor for the blocked time (dcp-floor: " in (tmp_path / "bench.md").read_text()
    assert "0.130 s, 1.30x that copy." in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("uc_copy_s", [1.2, 0.05])  # a cold copy (the first of a run), a short one
def test_blocked_time_is_judged_against_the_combos_copy_not_the_cases_own(tmp_path: Path, uc_copy_s: float) -> None:
    # Every case times the same in-memory copy in its own process; one cold copy in ours must
    # neither flatter its blocked time ("0.10x, met" in a tester's 1-repeat run) nor sink it.
    results = _costs(32, uc_save=0.3, naive_save=0.2)
    for r in results:
        if r["name"] == "uc-s3":
            r.update(memcopy_s=uc_copy_s, blocked_s=0.15, sync_peak_extra_bytes=MIB)
    m = medians(results)
    combo = ("gpt", 32, 1, "moto")
    rows = {label: (want, got, ok) for label, want, got, ok in cost_targets(m, combo)}
    # 0.15 s against the median copy of uc-s3, boto3, s3tc: 0.1 s
    assert rows["async_save blocked time vs an in-memory copy (synchronous staging)"] == ("<= 1.1x", "1.50x", False)
    assert {label: got for label, _w, got, _ok in target_ratios(m, combo)}[
        "async_save blocked time vs an in-memory copy"
    ] == "1.50x"


def test_a_ratio_is_judged_as_shown() -> None:
    # The same CPU measured twice, with float noise: 0.030000000000000027 / 0.029999999999999805 is
    # 1.0000000000000074, shown as 1.00x, and must meet "<= 1.0x".
    m = medians(_costs(256, uc_save=0.8, naive_save=1.0))
    combo = ("gpt", 256, 1, "moto")
    for row in m.values():
        row.pop("load_cpu_s", None)
        row.pop("download_cpu_s", None)
    m[(combo, "uc-s3")]["load_cpu_s"] = 0.030000000000000027
    m[(combo, "boto3")]["download_cpu_s"] = 0.029999999999999805
    rows = {label: (got, ok) for label, _w, got, ok in cost_targets(m, combo)}
    assert rows["load client CPU vs raw boto3 download"] == ("1.00x", True)


def test_the_unsigned_payload_option_is_compared_with_s3torchconnector_apart() -> None:
    gib = 256 / 1024
    unsigned = [
        _result("uc-s3-unsigned", rep, 256, blocked_s=0.1, publish_s=0.7, sync_save_s=0.7, sync_save_cpu_s=2.0 * gib)
        for rep in range(3)
    ]
    m = medians(_costs(256, uc_save=0.8, naive_save=1.0) + unsigned)
    rows = {label: (want, got, ok) for label, want, got, ok in cost_targets(m, ("gpt", 256, 1, "moto"))}
    # the default's figure stays ours at 3.0 CPU-s/GiB against s3tc's 2.5; the option's is 2.0 / 2.5
    assert rows["save client CPU vs s3torchconnector (aim)"] == ("<= 1.5x", "1.20x", True)
    option = "the same, both UNSIGNED-PAYLOAD (ours: the sign_payload=False option)"
    assert rows[option] == ("<= 1.5x", "0.80x", True)


def test_the_profile_counts_running_samples_only() -> None:
    """py-spy samples of a thread waiting on a lock, a condition, a queue or a future (a futex
    wait that py-spy cannot name included) are not CPU; everything else is charged to a category."""
    from benchmarks.profile import breakdown

    raw = "\n".join(
        [
            "run (threading.py:1002);_worker (uc_checkpoint/engine/transfer.py:80);"
            "sha256 (hashlib.py:1);SHA256_Update (libcrypto.so.3) 7",
            "main (x.py:1);results (uc_checkpoint/engine/transfer.py:149);wait (threading.py:629);"
            "0x7f4c724a3f16 (libc.so.6) 5",
            "main (x.py:1);finish (uc_checkpoint/engine/upload.py:115);Condition.__enter__ (threading.py:272) 4",
            "main (x.py:1);get (queue.py:171);pthread_cond_timedwait (libc.so.6) 3",
            "main (x.py:1);write_files (uc_checkpoint/dcp/serialize.py:180);0x7f4c724a3f16 (libc.so.6) 2",
        ]
    )
    counts, total = breakdown(raw)
    assert total == 9
    assert counts["SigV4 SHA-256 of bodies (plain HTTP)"] == 7
    assert counts["our pipeline (upload/fetch scheduling, publish)"] == 2  # a libc frame under our own code runs


def test_the_kept_buffers_blocked_time_is_its_own_row() -> None:
    results = _costs(32, uc_save=0.3, naive_save=0.2)
    for r in results:
        if r["name"] == "uc-s3":
            r["blocked_kept_s"] = {0: 0.05, 1: 0.04, 2: 0.2}[r["repeat"]]  # median 0.05
    combo = ("gpt", 32, 1, "moto")
    rows = {label: (want, got, ok) for label, want, got, ok in cost_targets(medians(results), combo)}
    label = "the same, staging buffers kept between saves (Staging(reuse_buffers=True), 2nd save on)"
    assert rows[label] == ("<= 1.1x", "0.50x", True)  # against the 0.1 s copy
    # runs without that measure (older ones, other cases) have no such row
    assert label not in {r[0] for r in cost_targets(medians(_costs(32, uc_save=0.3, naive_save=0.2)), combo)}


def test_a_phase_run_several_times_keeps_each_figures_median(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import case

    figures = iter([(0.10, 0.05), (0.90, 0.40), (0.12, 0.07), (0.11, 0.30), (0.50, 0.06)])

    @contextmanager
    def timed(out: dict[str, Any], name: str, heat: int = 0) -> Iterator[None]:
        yield
        out[f"{name}_s"], out[f"{name}_cpu_s"] = next(figures)

    monkeypatch.setattr(case, "_timed", timed)
    seen: list[int] = []
    out: dict[str, Any] = {}
    case._timed_calls(out, "sync_save", 5, seen.append)
    assert seen == [0, 1, 2, 3, 4]
    # each figure's own median (not the figures of the median call)
    assert out == {"sync_save_s": 0.12, "sync_save_cpu_s": 0.07, "sync_save_calls": 5}


def _committed(tmp_path: Path) -> Path:
    path = tmp_path / "benchmarks.json"
    args = {
        "size_mb": 256,
        "kinds": ["gpt:32", "gpt:256"],
        "ranks": [1],
        "repeats": 3,
        "cases": ["uc-s3", "boto3", "s3tc"],
        "stores": ["moto", "localbucket"],
    }
    path.write_text(json.dumps({"args": args, "skipped_cases": ["s3tc"], "results": []}))
    return path


def test_a_run_covering_less_than_the_committed_one_is_named_so(tmp_path: Path) -> None:
    committed = _committed(tmp_path)

    def run(
        kinds: list[str],
        *,
        ranks: tuple[int, ...] = (1,),
        repeats: int = 3,
        cases: tuple[str, ...] = ("uc-s3", "boto3"),
        stores: tuple[str, ...] = ("moto", "localbucket"),
    ) -> str | None:
        args = argparse.Namespace(ranks=list(ranks), repeats=repeats)
        return narrower_run(committed, [parse_kind(k, 256) for k in kinds], args, list(cases), list(stores))

    assert run(["gpt:32", "gpt"]) is None  # the same grid (s3tc was skipped there)
    assert run(["gpt:32", "gpt:256", "gpt:1024"], ranks=(1, 2), repeats=5) is None  # more
    assert run(["gpt:32"]) == "sizes gpt:256"
    assert run(["gpt:32", "gpt:256"], repeats=1, cases=("uc-s3",), stores=("moto",)) == (
        "cases boto3; stores localbucket; 1 repeats against 3"
    )
    assert run(["gpt:32", "gpt:256"], ranks=(2,)) == "ranks 1"
    assert narrower_run(tmp_path / "none.json", [("gpt", 32)], argparse.Namespace(ranks=[1], repeats=1), [], []) is None
