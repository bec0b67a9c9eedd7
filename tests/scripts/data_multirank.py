"""Run under ``torchrun``: the data tracker across real ranks, real DataLoader workers and a real DCP
checkpoint (UCVolumeWriter / UCVolumeReader, local volume).

Usage: data_multirank.py PHASE CKPT OUT WORKERS
  save:   consume an uneven number of batches per rank (rank r: 2 + 3r), ``dcp.async_save`` the data
          state with a tensor, consume two more batches per rank (progress a preemption loses: it is
          after the checkpoint), then exit. Writes OUT/save-rank<r>.json with what was consumed
          before and after the save.
  resume: ``dcp.load`` the state (any world size, WORKERS workers per rank), consume the rest of the
          epoch, write OUT/resume-rank<r>.json with what was consumed and the resume summary.
Samples are (shard, offset) pairs; the pytest side compares them with one whole epoch.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.data.tracker import DataTracker, ShardSpec

warnings.filterwarnings("ignore")

SIZES = (40, 3, 57, 0, 21, 64, 9, 30, 17)
SHARDS = [ShardSpec(f"s3://corpus/train-{i:04d}.tar", n) for i, n in enumerate(SIZES)]
INDEX = {s.name: i for i, s in enumerate(SHARDS)}


def read_shard(shard: ShardSpec, start: int, end: int):
    for offset in range(start, end):
        yield (INDEX[shard.name], offset)


def pairs(batch) -> list[list[int]]:
    return [list(p) for p in zip(batch[0].tolist(), batch[1].tolist())]


def main() -> int:
    phase, ckpt, out, workers = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tracker = DataTracker(SHARDS, seed=11, rank=rank, world_size=world, num_workers=workers)
    loader = TrackedDataLoader(TrackedShardDataset(tracker, read_shard), batch_size=4, num_workers=workers)
    state = {"w": torch.full((8,), float(rank)), "data": loader}
    if phase == "save":
        before, after = [], []
        it = iter(loader)
        for _ in range(2 + 3 * rank):
            before += pairs(next(it))
        fut = dcp.async_save(state, storage_writer=UCVolumeWriter(ckpt))
        for _ in range(2):
            after += pairs(next(it))
        fut.result()
        (out / f"save-rank{rank}.json").write_text(json.dumps({"before": before, "after": after}))
    else:
        dcp.load(state, storage_reader=UCVolumeReader(ckpt))
        summary = tracker.resume_summary()
        seen = []
        for batch in loader:
            seen += pairs(batch)
        gathered = [None] * world
        dist.all_gather_object(gathered, tracker.local_state())
        (out / f"resume-rank{rank}.json").write_text(
            json.dumps({"seen": seen, "summary": summary, "epoch_done": tracker.epoch_done(gathered)})
        )
    dist.barrier()
    dist.destroy_process_group()
    print(f"RANK {rank} {phase} OK", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
