"""An async save's hand-over from the caller's thread to DCP's save thread
(uc_checkpoint.dcp.handover), and the report of a background save that failed where no hook of
ours saw it. No stack frames are read and nothing sleeps: the package is searched for both."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from uc_checkpoint import UCVolumeWriter
from uc_checkpoint.dcp import compat as dcp_compat
from uc_checkpoint.dcp import handover
from uc_checkpoint.dcp.handover import BACKGROUND, Handover, StagedSave

PACKAGE = Path(__file__).resolve().parents[2] / "uc_checkpoint"


def _staged(where: str = "loc") -> StagedSave:
    return StagedSave(where, None, threading.current_thread(), None)


def _on_thread(name: str, fn: Any) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), name=name)
    thread.start()
    thread.join(30)
    return out[0]


def test_only_dcps_save_thread_takes_a_staging() -> None:
    slot = Handover()
    staged = _staged()
    slot.put(staged)
    assert slot.take() is None  # this thread: a synchronous save, or the caller itself
    assert _on_thread("user-thread", slot.take) is None
    taken = _on_thread(f"{dcp_compat.DCP_ASYNC_THREAD_PREFIX}_0", slot.take)
    assert taken is staged and slot.staged is None
    assert staged.report.thread is not None and staged.report.thread.name.startswith(dcp_compat.DCP_ASYNC_THREAD_PREFIX)
    staged.report.end()


def test_a_second_staging_waits_for_dcps_thread_to_take_the_first() -> None:
    slot = Handover()
    first, second = _staged("A"), _staged("B")
    slot.put(first)
    go, took = threading.Event(), []

    def dcp_thread() -> None:
        assert go.wait(30)
        took.append(slot.take())

    thread = threading.Thread(target=dcp_thread, name=f"{dcp_compat.DCP_ASYNC_THREAD_PREFIX}_1")
    thread.start()
    putter = threading.Thread(target=slot.put, args=(second,))
    putter.start()
    putter.join(0.3)
    assert putter.is_alive() and slot.staged is first  # waiting: a DCP save thread is alive
    go.set()
    putter.join(30)
    thread.join(30)
    assert took == [first] and slot.staged is second and not first.report.ended
    first.report.end()
    second.drop("test over")


def test_a_staging_no_thread_takes_is_dropped_by_the_next_at_once() -> None:
    slot = Handover()
    stale, fresh = _staged("A"), _staged("B")
    slot.put(stale)
    slot.put(fresh, wait_s=60)  # no DCP save thread alive: nothing to wait for
    assert slot.staged is fresh and stale.report.ended
    assert "never reached the writer" in str(stale.report.error)
    fresh.drop("test over")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_save_dcp_stops_between_our_hooks_is_logged_when_in_the_background(
    mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An async save whose future nobody reads must not fail without a word; a synchronous one
    # raised into its caller, which is word enough.
    class FailingGlobalPlan(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            raise RuntimeError("another rank's plan failed")

    where = tmp_path / f"ckpt-{mode}"
    state, writer = {"w": torch.ones(8)}, UCVolumeWriter(where)
    with caplog.at_level(logging.ERROR, logger=handover.__name__):
        if mode == "async":
            fut = dcp.async_save(state, storage_writer=writer, planner=FailingGlobalPlan(), no_dist=True)
            with pytest.raises(BaseException, match="another rank's plan failed"):
                fut.result(timeout=60)
            for thread in threading.enumerate():  # DCP's save thread ends after its future
                if thread.name.startswith(dcp_compat.DCP_ASYNC_THREAD_PREFIX):
                    thread.join(30)
        else:
            with pytest.raises(BaseException, match="another rank's plan failed"):
                dcp.save(state, storage_writer=writer, planner=FailingGlobalPlan(), no_dist=True)
        BACKGROUND.report()  # what the next save's stage() (or the exit) does
        BACKGROUND.report()  # once only
    logged = [r.getMessage() for r in caplog.records if r.name == handover.__name__ and str(where) in r.getMessage()]
    if mode == "async":
        assert len(logged) == 1 and "failed in the background: DCP stopped it between the writer's steps" in logged[0]
    else:
        assert logged == []
    assert not (where / ".metadata").exists()


def test_a_background_save_that_fails_in_our_hooks_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with caplog.at_level(logging.ERROR, logger=handover.__name__):
        fut = dcp.async_save({"w": torch.ones(8)}, storage_writer=UCVolumeWriter(blocker / "ckpt"), no_dist=True)
        with pytest.raises(BaseException, match="is a file"):
            fut.result(timeout=60)
        BACKGROUND.report()
    logged = [r.getMessage() for r in caplog.records if r.name == handover.__name__]
    assert len(logged) == 1 and "failed in the background" in logged[0] and str(blocker) in logged[0], logged


def test_the_package_reads_no_stack_frames_and_hands_no_gil_over_by_sleeping() -> None:
    frames = re.compile(r"sys\._getframe|\.f_back\b|\.f_locals\b|inspect\.(currentframe|stack)\(")
    sleeps = re.compile(r"time\.sleep\(")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        found += [f"{path.relative_to(PACKAGE)}: frame access" for _ in frames.finditer(text)]
        if path.parent.name in ("dcp", "engine") or path.name == "workers.py":  # the save path
            found += [f"{path.relative_to(PACKAGE)}: sleep" for _ in sleeps.finditer(text)]
    assert not found, found


def test_overlapping_async_saves_each_record_their_own_location(tmp_path: Path) -> None:
    # A save's finish reads storage_meta(); it must not take the staging of the save staged next.
    writer = UCVolumeWriter(tmp_path / "base")
    for rnd in range(15):
        locs = [tmp_path / f"r{rnd}c{i}" for i in range(4)]
        futs = [
            dcp.async_save({"w": torch.full((4096,), float(i))}, storage_writer=writer, checkpoint_id=loc, no_dist=True)
            for i, loc in enumerate(locs)
        ]
        for fut in futs:
            fut.result(timeout=60)
        for loc in locs:
            meta = dcp.FileSystemReader(loc).read_metadata()
            assert str(meta.storage_meta.checkpoint_id).endswith(loc.name), (loc, meta.storage_meta)
