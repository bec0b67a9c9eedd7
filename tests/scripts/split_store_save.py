"""Run under ``torchrun --nproc_per_node=2``: a save in which rank 1's writer points at another S3
store than rank 0's (another endpoint on one node: a configuration mistake). Rank 1 runs its own
moto server (its own objects) and verifies its uploads against it; rank 0, the coordinator, must
still refuse to publish a ``.metadata`` whose rank-1 files are not on its store. Prints
``RANK <r> split REFUSED: <message>`` when the save fails as it must.

Usage: split_store_save.py s3://BUCKET/PREFIX   (rank 0's store: AWS_ENDPOINT_URL)
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.s3_fixtures import moto_server, s3_client
from uc_checkpoint import UCVolumeWriter
from uc_checkpoint.errors import rank_error
from uc_checkpoint.volumes import S3Volume

warnings.filterwarnings("ignore")


def save(dest: str, endpoint: str) -> None:
    rank = dist.get_rank()
    sd = {f"rank{rank}": torch.full((1 << 12,), float(rank))}
    try:
        dcp.save(sd, storage_writer=UCVolumeWriter(S3Volume(dest, endpoint_url=endpoint)))
    except CheckpointException as exc:
        print(f"RANK {rank} split REFUSED: {rank_error(exc)}", flush=True)
    else:
        print(f"RANK {rank} split PUBLISHED", flush=True)


def main() -> None:
    dest = sys.argv[1]
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        with moto_server() as other:  # a store of its own: this process's moto backend
            s3_client(other).create_bucket(Bucket=dest[5:].split("/", 1)[0])
            save(dest, other)
    else:
        save(dest, os.environ["AWS_ENDPOINT_URL"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
