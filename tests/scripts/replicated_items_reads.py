"""Run under ``torchrun --nproc_per_node=N`` (gloo on CPU): every rank saves the same replicated small
items (a step, optimizer-style scalars) beside large tensors of its own, to S3, once with DCP's
default planner (``ROOT/default``) and once with ``UCSavePlanner`` (``ROOT/uc``), then loads each
back and compares every value. The endpoint (``AWS_ENDPOINT_URL``) is the tests' fault proxy, which
counts the GETs each layout costs. Prints ``RANK <r> <mode> OK``.

Usage: replicated_items_reads.py ROOT   (ROOT an ``s3://bucket/prefix`` URL)
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from uc_checkpoint import UCSavePlanner, UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions

warnings.filterwarnings("ignore")

SCALARS = 24
LARGE = 1 << 18  # float32 elements: 1 MiB, one data file each with file_size_bytes below


def state(rank: int, fill: float | None = None) -> dict:
    def value(x: float) -> float:
        return x if fill is None else fill

    return {
        "step": 7 if fill is None else -1,
        "opt": {f"s{i}": torch.tensor(value(float(i))) for i in range(SCALARS)},  # replicated
        f"rank{rank}": {f"w{j}": torch.full((LARGE,), value(rank * 10.0 + j)) for j in range(2)},  # own
    }


def main() -> None:
    root = sys.argv[1].rstrip("/")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode, planner in (("default", None), ("uc", UCSavePlanner())):
        dcp.save(
            state(rank),
            storage_writer=UCVolumeWriter(f"{root}/{mode}", options=WriterOptions(file_size_bytes=1 << 20)),
            planner=planner,
        )
        back = state(rank, fill=0.0)
        dcp.load(back, storage_reader=UCVolumeReader(f"{root}/{mode}"))
        want = state(rank)
        assert back["step"] == want["step"], (mode, back["step"])
        for group in ("opt", f"rank{rank}"):
            for key, value in want[group].items():
                assert torch.equal(back[group][key], value), (mode, group, key)
        dist.barrier()
        print(f"RANK {rank} {mode} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
