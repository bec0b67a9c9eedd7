"""Run under ``torchrun --nproc_per_node=2``: CheckpointManager across real ranks.

Usage: manager_multirank.py ROOT [MODE ...]   (default mode: ``agree``)

Mode ``agree``:
1. Saves steps 1..3 (async, keep_last=2): each rank's own tensor plus a replicated one; every rank
   must agree on latest() == 3, list the same checkpoints, and load step 3 exactly.
2. A manager whose root is a file: rank 0's listing fails; every rank must raise (rank 1 gets rank
   0's error through the broadcast) and none may hang.

Mode ``inflight``: ``load()`` called right after the manager's own async save (a replicated tensor
of 24,000,000 float32 per rank: its upload is still running), with and without async staging, each
sequence under a fresh root ``ROOT/inflight-...``: save step 1 then ``load()`` / ``load(step=1)``;
step 1 published, save step 2 then ``load()`` / ``load(step=2)``: every rank must load the step just
saved. Then a save of step 2 that fails in flight (its location holds a file that is not part of a
checkpoint, which rank 0's claim refuses): ``load()`` must raise that save's error on every rank,
as ``wait()`` would, and the next ``load()`` loads step 1.

Prints ``RANK <r> <mode> OK`` per mode.
"""

from __future__ import annotations

import logging
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.errors import LocationNotEmptyError, VolumeError, rank_error
from uc_checkpoint.ops.manager import CheckpointManager

warnings.filterwarnings("ignore")
logger = logging.getLogger("manager_multirank")

#: Elements of the replicated tensor of mode ``inflight`` (float32: 96 MB per rank).
BIG = 24_000_000


def state(step: int, rank: int) -> dict:
    return {f"rank{rank}": torch.full((16,), float(100 * step + rank)), "shared": torch.arange(8.0) * step}


def agree(root: Path, group: dist.ProcessGroup) -> None:
    rank = dist.get_rank()
    manager = CheckpointManager(str(root / "run"), keep_last=2, process_group=group)
    for step in (1, 2, 3):
        manager.save(step, state(step, rank))
    manager.wait()
    assert manager.latest() == 3
    assert [(i.step, i.published) for i in manager.list()] == [(2, True), (3, True)], manager.list()
    target = {f"rank{rank}": torch.zeros(16), "shared": torch.zeros(8)}
    assert manager.load(target) == 3
    expected = state(3, rank)
    assert all(torch.equal(target[k], expected[k]) for k in expected), target

    if rank == 0:
        (root / "a-file").write_text("not a directory")
    dist.barrier()
    broken = CheckpointManager(str(root / "a-file"), process_group=group)
    try:
        broken.latest()
    except VolumeError as exc:
        assert "a-file" in str(exc), exc
    else:
        raise AssertionError("latest() on a file root did not raise")
    dist.barrier()


def big_state(step: int, rank: int) -> dict[str, Any]:
    return {
        "w": torch.full((BIG,), float(step)),
        f"rank{rank}": torch.full((4,), float(100 * step + rank)),
        "step": step,
    }


def blank(rank: int) -> dict[str, Any]:
    return {"w": torch.zeros(BIG), f"rank{rank}": torch.zeros(4), "step": -1}


def loaded(target: dict[str, Any], step: int, rank: int) -> bool:
    expected = big_state(step, rank)
    return all(
        torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v for k, v in expected.items()
    )


def load_right_after_save(
    root: Path, group: dist.ProcessGroup, background_copy: bool, published: bool, explicit: bool
) -> None:
    """Save (step 2 over a published step 1, or step 1), then at once load it on every rank."""
    rank = dist.get_rank()
    manager = CheckpointManager(
        str(root), keep_last=None, process_group=group, staging=Staging(background_copy=background_copy)
    )
    step = 2 if published else 1
    if published:
        manager.save(1, big_state(1, rank))
        manager.wait()
    done = manager.save(step, big_state(step, rank))
    in_flight = not done.done()
    target = blank(rank)
    got = manager.load(target, step=step if explicit else None)
    assert got == step, f"rank {rank}: load() gave step {got}, not the step {step} just saved under {root}"
    assert loaded(target, step, rank), f"rank {rank}: the state loaded from {root} is not step {step}'s"
    logger.info(
        "rank %d: %s: the save was %s when load() was called", rank, root.name, "in flight" if in_flight else "done"
    )
    manager.wait()


def load_after_failing_save(root: Path, group: dist.ProcessGroup) -> None:
    """Step 1 published; step 2's save fails in flight: load() raises its error on every rank."""
    rank = dist.get_rank()
    manager = CheckpointManager(str(root), keep_last=None, process_group=group)
    manager.save(1, big_state(1, rank))
    manager.wait()
    if rank == 0:
        (root / "step_00000002").mkdir()
        (root / "step_00000002" / "notes.txt").write_text("not part of a checkpoint")
    dist.barrier()
    manager.save(2, big_state(2, rank))
    try:
        got = manager.load(blank(rank))
    except CheckpointException as exc:
        assert isinstance(rank_error(exc), LocationNotEmptyError), f"rank {rank}: {exc}"
    else:
        raise AssertionError(f"rank {rank}: load() gave step {got} although the save of step 2 failed")
    target = blank(rank)
    assert manager.load(target) == 1 and loaded(target, 1, rank)  # the error was raised once, as by wait()


def inflight(root: Path, group: dist.ProcessGroup) -> None:
    for background_copy in (False, True):
        for published in (False, True):
            for explicit in (False, True):
                name = f"inflight-{'background-copy' if background_copy else 'staged'}-{int(published)}-{int(explicit)}"
                load_right_after_save(root / name, group, background_copy, published, explicit)
                dist.barrier()
                if dist.get_rank() == 0:
                    shutil.rmtree(root / name)  # each sequence writes hundreds of MB
    load_after_failing_save(root / "inflight-fails", group)
    dist.barrier()


MODES = {"agree": agree, "inflight": inflight}


def main() -> int:
    root = Path(sys.argv[1])
    modes = sys.argv[2:] or ["agree"]
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("uc_checkpoint").setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    for mode in modes:
        MODES[mode](root, group)
        print(f"RANK {rank} {mode} OK", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
