"""Run under ``torchrun --nproc_per_node=2``: ``CheckpointManager.should_save`` across real ranks.

Usage: interval_multirank.py ROOT

For each policy (``EverySeconds``, ``BlockedFraction``), a training loop of async saves where rank 1's
steps take longer than rank 0's (a sleep) and the loop has no collective of its own: every rank
calls ``should_save(step)`` at every step and saves when it says so. Then (after the loop, with
collectives of the test's own) every rank must have saved at exactly the same steps, at least
twice, and every one of those checkpoints must be published and load.

Prints ``RANK <r> <policy> OK`` per policy.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from uc_checkpoint.ops.interval import BlockedFraction, EverySeconds, IntervalPolicy
from uc_checkpoint.ops.manager import CheckpointManager

warnings.filterwarnings("ignore")
logger = logging.getLogger("interval_multirank")

STEPS = 40


def state(step: int, rank: int) -> dict:
    return {f"rank{rank}": torch.full((1024,), float(step)), "shared": torch.arange(64.0) * step}


def loop(root: Path, name: str, policy: IntervalPolicy) -> None:
    rank = dist.get_rank()
    manager = CheckpointManager(str(root / name), keep_last=None, save_interval=policy)
    # Different step times per rank: the leader's clock decides for both.
    step_s = 0.01 if rank == 0 else 0.03
    saved = []
    for step in range(STEPS):
        time.sleep(step_s)
        if manager.should_save(step):
            manager.save(step, state(step, rank))
            saved.append(step)
    manager.wait()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, saved)
    assert all(s == everyone[0] for s in everyone), everyone
    assert len(saved) >= 2, saved
    published = [i.step for i in manager.list() if i.published]
    assert published == saved, (published, saved)
    for step in saved:
        target = {f"rank{rank}": torch.zeros(1024), "shared": torch.zeros(64)}
        assert manager.load(target, step=step) == step
        assert torch.equal(target["shared"], torch.arange(64.0) * step)
    logger.info("rank %d %s saved at %s", rank, name, saved)
    print(f"RANK {rank} {name} OK", flush=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    dist.init_process_group("gloo")
    root = Path(sys.argv[1])
    try:
        loop(root, "every_seconds", EverySeconds(0.15))
        loop(root, "blocked_fraction", BlockedFraction(0.5))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
