"""The report of a background save that failed where no hook of ours saw it
(uc_checkpoint.dcp.background), a writer object's one save at a time, and: no stack frames are
read and nothing sleeps (the package is searched for both)."""

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
from uc_checkpoint.dcp import background
from uc_checkpoint.dcp.background import BACKGROUND

PACKAGE = Path(__file__).resolve().parents[2] / "uc_checkpoint"


def _dcp_save_threads() -> list[threading.Thread]:
    """Threads other than this one and the ones alive before the test (DCP's save threads)."""
    return [t for t in threading.enumerate() if t is not threading.current_thread() and t.name not in BEFORE]


BEFORE = {t.name for t in threading.enumerate()}


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
    with caplog.at_level(logging.ERROR, logger=background.__name__):
        if mode == "async":
            fut = dcp.async_save(state, storage_writer=writer, planner=FailingGlobalPlan(), no_dist=True)
            with pytest.raises(BaseException, match="another rank's plan failed"):
                fut.result(timeout=60)
            for thread in _dcp_save_threads():  # DCP's save thread ends after its future
                thread.join(30)
        else:
            with pytest.raises(BaseException, match="another rank's plan failed"):
                dcp.save(state, storage_writer=writer, planner=FailingGlobalPlan(), no_dist=True)
        BACKGROUND.report()  # what the next save's stage() (or the exit) does
        BACKGROUND.report()  # once only
    logged = [r.getMessage() for r in caplog.records if r.name == background.__name__ and str(where) in r.getMessage()]
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
    with caplog.at_level(logging.ERROR, logger=background.__name__):
        fut = dcp.async_save({"w": torch.ones(8)}, storage_writer=UCVolumeWriter(blocker / "ckpt"), no_dist=True)
        with pytest.raises(BaseException, match="is a file"):
            fut.result(timeout=60)
        BACKGROUND.report()
    logged = [r.getMessage() for r in caplog.records if r.name == background.__name__]
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
    # One writer per save (DCP's contract): each save's finish records its own location.
    for rnd in range(15):
        locs = [tmp_path / f"r{rnd}c{i}" for i in range(4)]
        futs = [
            dcp.async_save(
                {"w": torch.full((4096,), float(i))},
                storage_writer=UCVolumeWriter(tmp_path / "base"),
                checkpoint_id=loc,
                no_dist=True,
            )
            for i, loc in enumerate(locs)
        ]
        for fut in futs:
            fut.result(timeout=60)
        for loc in locs:
            meta = dcp.FileSystemReader(loc).read_metadata()
            assert str(meta.storage_meta.checkpoint_id).endswith(loc.name), (loc, meta.storage_meta)
