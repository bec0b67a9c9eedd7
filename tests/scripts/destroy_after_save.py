"""Run under ``torchrun --nproc_per_node=2``: ``CheckpointManager.save`` (async), then at once
``dist.destroy_process_group()`` and exit, as scripts that forget ``manager.wait()`` do.

Usage: destroy_after_save.py ROOT. Each rank saves its own key ``r<rank>`` = arange(2e6) + rank.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

from uc_checkpoint import CheckpointManager

warnings.filterwarnings("ignore")


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    manager = CheckpointManager(sys.argv[1])
    manager.save(3, {f"r{rank}": torch.arange(2_000_000, dtype=torch.float32) + rank})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
