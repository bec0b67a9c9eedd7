"""The scale report's arithmetic: growth classification, flagging, the request kinds, the section in
docs/benchmarks.md (spliced by benchmarks.scale, kept by benchmarks.report's regeneration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fmt import MIB
from benchmarks.report import write_report
from benchmarks.scale import api_of, split_at_mark
from benchmarks.scale_case import PHASE_MARK
from benchmarks.scale_report import (
    BEGIN,
    END,
    Series,
    findings,
    growth,
    render,
    section_for,
    series_of,
    splice,
    update_main_report,
)
from tests.support.s3_fixtures import ProxyRecord


@pytest.mark.parametrize(
    ("ys", "label"),
    [
        ([3, 3, 3], "constant"),
        ([23, 203, 2003], "linear"),  # a fixed part, then 2 per unit: linear above the smallest point
        ([1, 100, 10_000], "faster than linear"),
        ([5.0, 1.0, 0.2], "falling"),
        ([0, 0, 0], "constant"),
        ([1.0, 3.0, 10.0], "sublinear"),
    ],
)
def test_growth_labels(ys: list[float], label: str) -> None:
    assert growth([10, 100, 1000], ys).label == label


def test_growth_fits_the_marginal_cost_and_refuses_one_x() -> None:
    g = growth([100, 1000, 10_000, 50_000], [0.3, 0.45, 1.8, 7.8])  # ~150 us per tensor above a fixed 0.3 s
    assert g.label == "linear"
    assert g.slope * 1e6 == pytest.approx(150, rel=0.02)
    with pytest.raises(ValueError, match="two distinct"):
        growth([10, 10], [1, 2])


def _reqs(total: int) -> dict[str, int]:
    return {"total": total, "GET": total}


def _data(latest_requests: list[int], files_per_rank: list[int]) -> dict:
    """A run's JSON with a checkpoints sweep whose latest() sends ``latest_requests`` at 10/100/1000
    checkpoints, and a fixed-share ranks sweep writing ``files_per_rank`` at 1/2/4 ranks."""
    ckpts = []
    for n, latest in zip((10, 100, 1000), latest_requests):
        row = {"checkpoints": n, "store_list_s": 0.005}
        for key, reqs, secs in (
            ("latest", latest, 0.01),
            ("list", n + 1, n * 1e-3),
            ("ls", 2 * n + 1, n * 4e-3),
            ("gc", 2 * n + 2, n * 4e-3),
            ("save", 14, 0.05),
        ):
            row[f"{key}_requests"], row[f"{key}_s"] = _reqs(reqs), secs
        ckpts.append(row)
    ranks = []
    for w, files in zip((1, 2, 4), files_per_rank):
        ranks.append(
            {
                "series": "share",
                "ranks": w,
                "size_mb": 32 * w,
                "bytes": 32 * w * MIB,
                "share_bytes": 32 * MIB,
                "save_s": 1.0 * w,
                "publish_s": 1.0 * w,
                "load_s": 0.5 * w,
                "files_per_rank": {str(r): files for r in range(w)},
                "files_max": files,
                "objects": files * w,
                "expected_files": 2,
                "requests_save": _reqs(10 + files * w),
                "requests_load": _reqs(1 + files * w),
            }
        )
    return {
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
        },
        "grid": {"repeats": 1, "tensors_total_mb": 16},
        "checkpoints": ckpts,
        "ranks": ranks,
    }


def test_a_latest_that_reads_every_checkpoint_is_flagged() -> None:
    good = _data([3, 3, 3], [2, 2, 2])
    assert findings(good, series_of(good)) == []
    bad = _data([12, 102, 1002], [2, 2, 2])  # one request per checkpoint
    found = findings(bad, series_of(bad))
    assert len(found) == 1 and "CheckpointManager.latest()" in found[0] and "linear" in found[0], found
    text = render(bad, {})
    assert "**Grows faster than it must:**" in text
    assert "| checkpoints | requests of CheckpointManager.latest() | 12 at 10, 102 at 100, 1002 at 1,000 |" in text


def test_files_per_rank_that_grow_with_the_world_size_are_flagged() -> None:
    bad = _data([3, 3, 3], [2, 4, 8])  # the rank sizing its files from the global tensor
    found = findings(bad, series_of(bad))
    assert any("data files per rank (fixed share per rank" in f for f in found), found
    assert any("do not follow the rank's share" in f for f in found), found


def test_request_kinds_and_the_phase_mark() -> None:
    assert api_of("GET", "/b?list-type=2&prefix=run%2F&delimiter=%2F") == "LIST"
    assert api_of("GET", "/b/run/step_00000001/.metadata") == "GET"
    assert api_of("GET", "/b/run/x?uploads") == "LIST"
    assert api_of("PUT", "/b/k?partNumber=2&uploadId=u") == "PART"
    assert api_of("POST", "/b/k?uploads") == "MPU"
    assert api_of("POST", "/b?delete") == "DELETE"
    assert api_of("HEAD", "/b/k") == "HEAD"
    recs = [
        ProxyRecord(m, p, None, "none", []) for m, p in (("PUT", "/b/a"), ("HEAD", f"/b/{PHASE_MARK}"), ("GET", "/b/a"))
    ]
    before, after = split_at_mark(recs)
    assert [r.method for r in before] == ["PUT"] and [r.method for r in after] == ["GET"]


def test_the_scale_section_survives_a_regeneration_of_the_main_report(tmp_path: Path) -> None:
    data = _data([3, 3, 3], [2, 2, 2])
    main = tmp_path / "benchmarks.md"
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "scale.json").write_text(json.dumps(data))
    # benchmarks.scale splices the section into an existing report, replacing an older one.
    main.write_text("# Benchmarks\n\nrun figures\n")
    update_main_report(main, data, tmp_path / "benchmarks-scale.md")
    update_main_report(main, data, tmp_path / "benchmarks-scale.md")
    text = main.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.startswith("# Benchmarks\n\nrun figures\n")
    assert "[benchmarks-scale.md](benchmarks-scale.md)" in text
    assert "| checkpoints | requests of CheckpointManager.latest() | constant in checkpoints" in text
    assert splice("a\n" + BEGIN + "\nold\n" + END + "\nb\n", ["NEW"]) == "a\nNEW\nb\n"
    # benchmarks.report rewrites the whole file and keeps the section (scale.json beside it).
    raw = {
        "machine": {**data["machine"], "s3fs_fuse": "s"},
        "args": {"size_mb": 256, "kinds": ["gpt"], "ranks": [1], "repeats": 1},
        "results": [],
    }
    write_report(raw, main)
    assert section_for(main)[0] == BEGIN
    assert BEGIN in main.read_text() and "## Scale" in main.read_text()


def test_a_cost_that_grows_only_as_fast_as_the_store_is_not_ours() -> None:
    xs = [256, 1024, 2048]
    store = Series("size", "raw download s", "MiB", xs, [0.3, 2.8, 9.0], None)
    load = Series("size", "load s", "MiB", xs, [0.7, 3.7, 11.1], 1, reference=store)
    assert load.growth.label == "faster than linear" and load.store_bound and not load.flagged
    alone = Series("size", "load s", "MiB", xs, [0.7, 3.7, 11.1], 1, reference=None)
    assert alone.flagged
    faster = Series("size", "load s", "MiB", xs, [0.7, 3.7, 30.0], 1, reference=store)
    assert faster.flagged, "steeper than the store's own download is still ours"


def test_links_stay_relative_when_the_reports_live_apart(tmp_path: Path) -> None:
    # The scale report written outside the main report's folder (e.g. a scratch run): the main
    # report's link goes up and across, never an absolute path of this machine.
    data = _data([3, 3, 3], [2, 2, 2])
    (tmp_path / "docs").mkdir()
    main = tmp_path / "docs" / "benchmarks.md"
    update_main_report(main, data, tmp_path / "scratch" / "scale.md")
    text = main.read_text()
    assert "(../scratch/scale.md)" in text and str(tmp_path) not in text


def test_each_store_of_the_size_sweep_is_judged_on_its_own() -> None:
    def row(mb: int, load_s: float, store: str | None) -> dict[str, object]:
        r: dict[str, object] = {
            "bytes": mb << 20,
            "size_mb": mb,
            "save_s": mb / 100,
            "load_s": load_s,
            "raw_download_s": mb / 400,
            "save_cpu_s": mb / 300,
            "load_cpu_s": mb / 900,
        }
        if store is not None:
            r["store"] = store
        return r  # fmt: skip

    # moto's load grows faster than its raw download (flagged); localbucket's is linear.
    data = {"size": [row(1024, 2.0, "moto"), row(2048, 9.0, "moto"), row(1024, 0.6, "localbucket"),
                     row(2048, 1.2, "localbucket")]}  # fmt: skip
    loads = {s.cost: s for s in series_of(data) if s.cost.startswith("load s")}
    assert set(loads) == {"load s (moto)", "load s (localbucket)"}
    assert loads["load s (moto)"].flagged and not loads["load s (localbucket)"].flagged
    assert loads["load s (localbucket)"].reference is not None
    # Rows from before the sweep named its store are moto's.
    old = {"size": [row(1024, 2.0, None), row(2048, 4.0, None)]}
    assert [s.cost for s in series_of(old) if s.cost.startswith("load s")] == ["load s (moto)"]
