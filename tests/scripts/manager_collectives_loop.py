"""Run under ``torchrun --nproc_per_node=2``: a training loop whose own collectives and the
manager's foreground agreement run while DCP's background save issues collectives of its own.

Usage: manager_collectives_loop.py ROOT GROUP STEPS [MODE]
    GROUP: ``own`` (the loop passes ``process_group=`` a gloo group it created for checkpoints, as the
    README shows) or ``default`` (``process_group=None``).
    MODE: ``thread`` (default) or ``process`` (DCP's async_checkpointer_type).

Every step: an all-reduce and a barrier on the default group (values checked), an async save, a
random 0-50 ms pause (different per rank, as step times vary), ``preemption_requested()``, and every
few steps ``latest()``/``list()``. Afterwards every step's checkpoint is loaded through the manager
and checked. Prints ``RANK <r> OK`` at the end.
"""

from __future__ import annotations

import random
import sys
import time
import warnings

import torch
import torch.distributed as dist

from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops.manager import CheckpointManager

warnings.filterwarnings("ignore")


def state(step: int, rank: int) -> dict[str, torch.Tensor]:
    return {f"rank{rank}": torch.full((256,), float(1000 * step + rank)), "shared": torch.arange(64.0) + step}


def main() -> int:
    root, group_kind, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "thread"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo") if group_kind == "own" else None
    manager = CheckpointManager(root, keep_last=None, process_group=group, staging=Staging(mode=mode))
    rng = random.Random(rank * 7919 + steps)
    for step in range(1, steps + 1):
        value = torch.tensor([float(step * (rank + 1))])
        dist.all_reduce(value)
        expected = float(step * sum(r + 1 for r in range(world)))
        assert value.item() == expected, (step, value.item(), expected)
        manager.save(step, state(step, rank))
        time.sleep(rng.uniform(0.0, 0.05))
        assert manager.preemption_requested() is False
        if step % 5 == 0:
            # latest() may lag behind the save in flight; it must name a published earlier step.
            found = manager.latest()
            assert found is not None and step - 1 <= found <= step, (step, found)
            assert [i.step for i in manager.list()][: step - 1] == list(range(1, step)), manager.list()
        dist.barrier()
    manager.wait()
    assert manager.latest() == steps
    for step in range(1, steps + 1):
        target = {f"rank{rank}": torch.zeros(256), "shared": torch.zeros(64)}
        assert manager.load(target, step=step) == step
        want = state(step, rank)
        assert all(torch.equal(target[k], want[k]) for k in want), (step, target)
    dist.barrier()
    dist.destroy_process_group()
    print(f"RANK {rank} OK", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
