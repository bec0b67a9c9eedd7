"""The checkpoint benchmark's cases (benchmarks/run.py, benchmarks/case.py) as pytest-benchmark
tests: each case saves and loads a GPT-style state dict in a fresh process and verifies what it
loaded. In the default test run (``--benchmark-disable``) each runs once at 8 MiB, so the harness
cannot rot; ``./scripts/test.sh benchmarks/test_checkpoint_io.py -n 0 --benchmark-enable --benchmark-only``
times them at ``UC_BENCH_MB`` (default 64). The full comparison with its report is
``./scripts/bench.sh``.

FUSE cases need root, /dev/fuse, s3fs and bindfs (``./scripts/bench.sh`` installs the tools; the
tests do not); without them they are skipped with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from benchmarks.run import DIRECT_BUCKET, FUSE_BUCKET, KEPT_BUFFERS_CASES, case_env, run_case

QUICK = bool(os.environ.get("UC_BENCH_QUICK"))
MB = 8 if QUICK else int(os.environ.get("UC_BENCH_MB", "64"))
FUSE_CASES = ("uc-s3fs", "fs-s3fs", "uc-bindfs", "fs-bindfs")
CASES = ("uc-s3", "uc-s3-unsigned", "fs-local", "s3tc", "boto3", "dcp-floor", *FUSE_CASES)


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, dict, str | None]]:
    """moto, the two buckets and (when possible) the s3fs and bindfs mounts, as benchmarks.run sets
    them up: (dirs, env, why FUSE cases are skipped or None)."""
    from benchmarks.mounts import bindfs_mount, fuse_problem, s3fs_mount
    from benchmarks.servers import make_bucket
    from tests.support.s3_fixtures import moto_server

    work = tmp_path_factory.mktemp("bench")
    dirs = {"work": work, "local": work / "local", "bind_src": work / "bind-src", "staging": work / "staging"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        url = stack.enter_context(moto_server())
        make_bucket(url, FUSE_BUCKET)
        make_bucket(url, DIRECT_BUCKET)
        no_fuse = fuse_problem()
        if no_fuse is None:
            dirs["s3fs"] = stack.enter_context(s3fs_mount(url, FUSE_BUCKET, work / "mnt-s3fs"))
            dirs["bindfs"] = stack.enter_context(bindfs_mount(dirs["bind_src"], work / "mnt-bindfs"))
        env = case_env(url, dirs["staging"], os.getpid())  # moto serves from threads of this process
        yield dirs, env, no_fuse


@pytest.mark.parametrize("name", CASES)
@pytest.mark.benchmark(group="checkpoint-save-load")
def test_case_saves_loads_and_verifies(benchmark, bench_env, name: str) -> None:
    dirs, env, no_fuse = bench_env
    if name in FUSE_CASES and no_fuse:
        pytest.skip(no_fuse)
    if name == "s3tc":
        pytest.importorskip("s3torchconnector.dcp", reason="s3torchconnector[dcp] is not installed (bench extra)")
    runs: list[list[dict]] = []
    benchmark.pedantic(
        lambda: runs.append(run_case(name, 1, "gpt", MB, dirs, env, 600)), rounds=1 if QUICK else 3, iterations=1
    )
    for results in runs:
        (result,) = results
        assert result["verified"] is True
        assert result["rank_bytes"] > (MB << 20) // 2
        if name == "boto3":
            assert result["upload_s"] > 0 and result["download_s"] > 0
        else:
            # Ordering the case measures must respect: async_save returns before .metadata exists.
            assert 0 < result["blocked_s"] <= result["publish_s"] <= result["async_done_s"] + 0.05
            assert result["load_s"] > 0
            # ours also times an async save into the staging buffers the first one left
            assert (result.get("blocked_kept_s", 0) > 0) == (name in KEPT_BUFFERS_CASES)
    last = runs[-1][0]
    benchmark.extra_info.update({k: v for k, v in last.items() if isinstance(v, (int, float))})


def test_the_floor_writer_stages_only_a_copy_and_saves_what_it_copied(tmp_path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from benchmarks.clients import CopyOnlyWriter

    sd = {"model": {"w": torch.arange(10.0)}, "step": 3}
    staged = CopyOnlyWriter(str(tmp_path / "probe")).stage(sd)
    assert torch.equal(staged["model"]["w"], sd["model"]["w"])
    assert staged["model"]["w"].data_ptr() != sd["model"]["w"].data_ptr()  # a copy, not a view
    writer = CopyOnlyWriter(str(tmp_path / "ckpt"))
    fut = dcp.async_save(sd, storage_writer=writer)
    sd["model"]["w"].add_(1)  # once async_save returned, training may change the state
    fut.result()
    assert writer._handed_over  # the save's thread went through the GIL hand-over
    out = {"model": {"w": torch.zeros(10)}, "step": 0}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "ckpt")))
    assert torch.equal(out["model"]["w"], torch.arange(10.0)) and out["step"] == 3


def test_timed_phase_starts_its_clock_after_the_memory_is_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed phase runs from the same page-cache and memory state (benchmarks/case.py's
    docstring): the drop, then the preheat, happen first and are not part of the phase's time."""
    import time

    from benchmarks import case

    steps: list[tuple[str, float, int]] = []

    def slow_drop() -> None:
        steps.append(("drop", time.perf_counter(), 0))
        time.sleep(0.2)

    def slow_preheat(nbytes: int) -> None:
        steps.append(("preheat", time.perf_counter(), nbytes))
        time.sleep(0.2)

    monkeypatch.setattr(case, "_drop_page_cache", slow_drop)
    monkeypatch.setattr(case, "_preheat", slow_preheat)
    out: dict = {}
    with case._timed(out, "naive_save", 3 << 20):
        inside = time.perf_counter()
    assert [(name, n) for name, _, n in steps] == [("drop", 0), ("preheat", 3 << 20)]
    assert steps[0][1] < steps[1][1] < inside
    assert 0 <= out["naive_save_s"] < 0.2
    assert out["naive_save_cpu_s"] >= 0


def test_the_preheat_touches_memory_outside_this_process() -> None:
    """The preheat must not raise the case process's own peak memory (VmHWM), which the save and
    load phases report as their peak extra memory."""
    from benchmarks import case
    from benchmarks.usage import peak_rss_above, reset_peak_rss, rss_bytes

    reset_peak_rss()
    before = rss_bytes()
    case._preheat(256 << 20)
    assert peak_rss_above(before) < 64 << 20  # far below the 256 MiB touched


def test_the_preheat_takes_at_most_half_the_memory_available(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import case

    assert 0 < case._available_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    touched: list[int] = []
    monkeypatch.setattr(case.subprocess, "run", lambda argv, check: touched.append(int(argv[-1])))
    monkeypatch.setattr(case, "_available_bytes", lambda: 8 << 20)
    case._preheat(3 << 30)  # a 1 GiB share's heat on a host with 8 MiB free
    case._preheat(1 << 20)
    assert touched == [4 << 20, 1 << 20]


def test_the_in_memory_copy_is_timed_settled_after_its_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy the async save's blocked time is compared with starts from the memory state the
    async save starts from, and its tiny warm-up comes after the settle (a drop can take code)."""
    from benchmarks import case, state

    calls: list[str] = []
    real_copy = state.cpu_copy
    monkeypatch.setattr(case, "_settle", lambda heat: calls.append(f"settle {heat}"))
    sd = state.build("gpt", 2 << 20, None)

    def copy(x: Any) -> Any:  # cpu_copy recurses: only the whole state dicts are recorded
        if isinstance(x, dict) and set(x) == set(sd):
            calls.append(f"copy {state.nbytes(x)}")
        return real_copy(x)

    monkeypatch.setattr(state, "cpu_copy", copy)
    assert case._timed_copy(sd) > 0
    tiny = state.nbytes(case._tiny_state())
    assert calls == [f"settle {case.HEAT_FACTOR * state.nbytes(sd)}", f"copy {tiny}", f"copy {state.nbytes(sd)}"]


def test_the_async_and_copy_warm_ups_are_too_small_to_leave_memory_for_the_timed_ones() -> None:
    from benchmarks import case, state

    tiny = case._tiny_state()
    assert state.nbytes(tiny) <= 1 << 20  # against 32 MiB and more timed
    # big enough that torch copies each tensor as it copies the real state's (above ATen's grain)
    assert all(t.numel() >= 32768 for t in (tiny["model"]["w"], tiny["optim"]["m"]))


def test_save_cases_time_a_load_only_after_an_untimed_one(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timed load runs with the load's code warm, as the raw download it is compared with runs
    after its own upload (benchmarks/case.py's docstring), and the untimed load comes after the
    async save, whose allocations it would otherwise serve."""
    import argparse
    from contextlib import contextmanager

    from benchmarks import case, state

    events: list[tuple[str, str, bool]] = []
    timing: list[bool] = [False]
    real_save, real_async, real_load, real_timed = case.dcp.save, case.dcp.async_save, case.dcp.load, case._timed

    @contextmanager
    def timed(out: dict, name: str, heat: int = 0) -> Iterator[None]:
        timing[0] = True
        with real_timed(out, name, heat):
            yield
        timing[0] = False

    def settle(heat: int) -> None:
        events.append(("settle", str(heat), timing[0]))

    def where(storage: object) -> str:
        return os.path.basename(str(storage.checkpoint_id))  # type: ignore[attr-defined]

    def save(sd, *, storage_writer, **kw):  # noqa: ANN001, ANN202
        events.append(("save", where(storage_writer), timing[0]))
        return real_save(sd, storage_writer=storage_writer, **kw)

    def async_save(sd, *, storage_writer, **kw):  # noqa: ANN001, ANN202
        events.append(("async_save", where(storage_writer), timing[0]))
        return real_async(sd, storage_writer=storage_writer, **kw)

    def load(sd, *, storage_reader, **kw):  # noqa: ANN001, ANN202
        events.append(("load", where(storage_reader), timing[0]))
        return real_load(sd, storage_reader=storage_reader, **kw)

    monkeypatch.setattr(case, "_settle", settle)
    monkeypatch.setattr(case, "_timed", timed)
    monkeypatch.setattr(case.dcp, "save", save)
    monkeypatch.setattr(case.dcp, "async_save", async_save)
    monkeypatch.setattr(case.dcp, "load", load)
    dest = str(tmp_path / "ckpt")
    args = argparse.Namespace(
        case="uc",
        dest=dest,
        visible=dest + "/.metadata",
        kind="gpt",
        size_mb=2,
        timeout=60.0,
        kept_buffers=False,
        calls=2,
    )
    sd = state.build("gpt", 2 << 20, None)
    out = case.run_save_load(args, sd, None, 0)

    assert out["verified"] and out["load_s"] > 0 and out["sync_save_calls"] == out["load_calls"] == 2
    heat = ("settle", str(case.HEAT_FACTOR * state.nbytes(sd)), True)  # inside _timed, before its clock
    assert (
        events
        == [
            ("save", "ckpt-warmup", False),
            ("async_save", "ckpt-warmup-async", False),  # the async path's code warm, on a tiny state
            heat,
            ("save", "ckpt-sync", True),
            heat,
            ("save", "ckpt-sync1", True),  # each timed call a save of its own
            heat[:2] + (False,),  # the async save from the same memory state as the timed phases
            ("async_save", "ckpt", False),
            ("load", "ckpt-warmup", False),
            heat,
            ("load", "ckpt", True),
            heat,
            ("load", "ckpt", True),
        ]
    )
