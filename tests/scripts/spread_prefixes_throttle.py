"""Run under ``torchrun --nproc_per_node=N`` (gloo on CPU): every rank saves many small data files
to S3 twice, once in the flat layout (``ROOT/flat``) and once spread over N key prefixes
(``ROOT/spread``), then loads both back. The endpoint (``AWS_ENDPOINT_URL``) is expected to be a
fault proxy that throttles by per-prefix request rate; the saves must succeed either way (through
retries). Prints ``RANK <r> <mode> OK <seconds of the save> <retries on this rank>``.

With LOCAL_DIR, the ranks also save spread over N prefixes to that directory, and every rank loads
every rank's tensors back with DCP's stock ``FileSystemReader`` (``RANK <r> stock OK``).

Usage: spread_prefixes_throttle.py ROOT [LOCAL_DIR]   (ROOT an ``s3://bucket/prefix`` URL)
"""

from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions

warnings.filterwarnings("ignore")

TENSORS = 32  # one data file each (file_size_bytes below one tensor): 32 PUTs and 32 HEADs per rank
ELEMENTS = 256


def state(rank: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((ELEMENTS,), float(rank * 1000 + i)) for i in range(TENSORS)}


def main() -> None:
    root = sys.argv[1].rstrip("/")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {f"rank{rank}": state(rank)}  # keys of this rank only: every rank writes its own files
    for mode, spread in (("flat", 1), ("spread", world)):
        writer = UCVolumeWriter(
            f"{root}/{mode}", options=WriterOptions(file_size_bytes=1024, upload_workers=4, spread_prefixes=spread)
        )
        dist.barrier()
        started = time.perf_counter()
        dcp.save(mine, storage_writer=writer)
        took = time.perf_counter() - started
        record = writer.last_record
        retries = record.retries if record is not None else -1
        back = {f"rank{rank}": {k: torch.zeros(ELEMENTS) for k in mine[f"rank{rank}"]}}
        dcp.load(back, storage_reader=UCVolumeReader(f"{root}/{mode}"))
        for key, value in mine[f"rank{rank}"].items():
            assert torch.equal(back[f"rank{rank}"][key], value), (mode, key)
        dist.barrier()
        print(f"RANK {rank} {mode} OK {took:.2f} {retries}", flush=True)
    if len(sys.argv) > 2:
        local = sys.argv[2]
        dcp.save(
            mine,
            storage_writer=UCVolumeWriter(local, options=WriterOptions(file_size_bytes=1024, spread_prefixes=world)),
        )
        everything = {f"rank{r}": {k: torch.zeros(ELEMENTS) for k in state(r)} for r in range(world)}
        dcp.load(everything, storage_reader=FileSystemReader(local))
        for r in range(world):
            for key, value in state(r).items():
                assert torch.equal(everything[f"rank{r}"][key], value), (r, key)
        dist.barrier()
        print(f"RANK {rank} stock OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
