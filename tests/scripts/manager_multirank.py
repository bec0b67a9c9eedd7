"""Run under ``torchrun --nproc_per_node=2``: CheckpointManager across real ranks.

Usage: manager_multirank.py ROOT
1. Saves steps 1..3 (async, keep_last=2): each rank's own tensor plus a replicated one; every rank
   must agree on latest() == 3, list the same checkpoints, and load step 3 exactly.
2. A manager whose root is a file: rank 0's listing fails; every rank must raise (rank 1 gets rank
   0's error through the broadcast) and none may hang.
Prints ``RANK <r> OK``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from uc_checkpoint.errors import VolumeError
from uc_checkpoint.ops.manager import CheckpointManager

warnings.filterwarnings("ignore")


def state(step: int, rank: int) -> dict:
    return {f"rank{rank}": torch.full((16,), float(100 * step + rank)), "shared": torch.arange(8.0) * step}


def main() -> int:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
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
    dist.destroy_process_group()
    print(f"RANK {rank} OK", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
