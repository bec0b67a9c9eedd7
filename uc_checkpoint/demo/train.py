"""One rank of the demo's training run; started by ``torchrun`` (see :mod:`uc_checkpoint.demo.run`).

A byte-level GPT sharded with FSDP2 over a CPU mesh trains with AdamW on the standard library's
sources. Every ``--save-every`` steps it calls ``dcp.async_save`` with :class:`UCVolumeWriter` into
``<volume>/step_<NNNNNNNN>``; at start it resumes from the newest published checkpoint there
(model, optimiser, every rank's RNG, step and data position). Rank 0 appends one JSON object per
event to ``--events`` so the orchestrator can follow, and kill, the run.

Run: ``torchrun --nproc_per_node=2 -m uc_checkpoint.demo.train --data D --volume V --events E ...``
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh

from ..checkpoints import checkpoint_name, latest_checkpoint
from ..reader import UCVolumeReader
from ..volumes import open_volume
from ..writer import UCVolumeWriter
from .data import ShardReader, ShardSet, step_sample_ids
from .model import GPT, GPTConfig, shard_model


class Events:
    """Rank 0's event log: one JSON object per line, flushed at once."""

    def __init__(self, path: str | None, rank: int) -> None:
        self._file = open(path, "a", encoding="utf-8") if path and rank == 0 else None  # noqa: SIM115

    def emit(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")
            self._file.flush()


class Batches:
    """Each rank's batch at each step, derived from (seed, step, rank): the data position is the
    step number, so restoring the step restores the data stream exactly."""

    def __init__(self, shards: ShardSet, seq_len: int, rank: int, world: int, batch: int, seed: int) -> None:
        self.shards, self.seq_len, self.rank, self.world, self.batch, self.seed = shards, seq_len, rank, world, batch, seed
        self.readers = [ShardReader(shards.path(i), seq_len) for i in range(len(shards.shards))]
        self.num_samples = shards.num_samples(seq_len)

    def position(self, step: int) -> dict[str, int]:
        """Samples consumed by all ranks before ``step``, as (epoch, offset into the epoch)."""
        consumed = step * self.world * self.batch
        return {"epoch": consumed // self.num_samples, "offset": consumed % self.num_samples, "samples": consumed}

    def get(self, step: int) -> torch.Tensor:
        ids = step_sample_ids(step, self.rank, self.world, self.batch, self.num_samples, self.seed)
        rows = []
        for sample_id in ids:
            shard, j = self.shards.locate(sample_id, self.seq_len)
            rows.append(self.readers[shard][j])
        return torch.stack(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="shard directory (index.json + shard files)")
    p.add_argument("--volume", help="checkpoint root on the volume; omit to train without checkpoints")
    p.add_argument("--events", help="file to append rank 0's JSON events to")
    p.add_argument("--final", required=True, help="where rank 0 writes the final full parameters")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--model", choices=("demo", "gpt2-small"), default="demo")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--async-mode", choices=("thread", "process"), default="thread")
    p.add_argument("--staging-dir", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)  # bit-exact results need a fixed intra-op thread count
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Checkpoint collectives run in DCP's background thread: give them their own process group so
    # they never interleave with the training collectives on the default group.
    ckpt_group = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,))
    events = Events(args.events, rank)

    config = GPTConfig.demo() if args.model == "demo" else GPTConfig.gpt2_small()
    torch.manual_seed(args.seed)
    model = shard_model(GPT(config), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    shards = ShardSet.load(args.data, verify_hashes=False)
    batches = Batches(shards, config.seq_len, rank, world, args.batch_size, args.seed)
    torch.manual_seed(args.seed + 1 + rank)  # dropout differs per rank, and is checkpointed

    start_step = 0
    volume = open_volume(args.volume) if args.volume else None
    if volume is not None:
        found = latest_checkpoint(volume) if rank == 0 else None
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
        if found is not None:
            start_step = resume(model, optimizer, batches, volume.child(found[1]).url, rank, world, events, args)
    events.emit("start", step=start_step, world_size=world, params=sum(p.numel() for p in model.parameters()))

    pending: Future | None = None
    step = start_step
    while step < args.steps:
        x = batches.get(step)
        _, loss = model(x[:, :-1], x[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        loss_value = loss.detach().clone()
        dist.all_reduce(loss_value)
        events.emit("step", step=step, loss=float(loss_value) / world)
        if volume is not None and step % args.save_every == 0:
            if pending is not None:
                pending.result()  # one save in flight at a time
            pending = save(model, optimizer, batches, step, volume.child(checkpoint_name(step)).url, rank, ckpt_group, events, args)
    if pending is not None:
        pending.result()

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        tmp = Path(args.final + ".tmp")
        torch.save(full, tmp)
        os.replace(tmp, args.final)
    events.emit("done", step=step)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def train_state(model: GPT, optimizer: torch.optim.Optimizer, batches: Batches, step: int, rank: int) -> dict[str, Any]:
    """The checkpointed state: model and optimiser (DTensor shards), this rank's RNG under a key of
    its own, and the step with its data position."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "rng": {f"rank{rank}": torch.get_rng_state()},
        "train": {"step": step, "data": batches.position(step), "world_size": batches.world},
    }


def save(
    model: GPT, optimizer: torch.optim.Optimizer, batches: Batches, step: int, location: str, rank: int,
    group: dist.ProcessGroup, events: Events, args: argparse.Namespace,
) -> Future:
    started = time.perf_counter()
    mode = AsyncCheckpointerType.PROCESS if args.async_mode == "process" else AsyncCheckpointerType.THREAD
    fut = dcp.async_save(
        train_state(model, optimizer, batches, step, rank),
        storage_writer=UCVolumeWriter(location, staging_dir=args.staging_dir),
        process_group=group,
        async_checkpointer_type=mode,
    )
    blocked = time.perf_counter() - started
    events.emit("save_start", step=step, location=location, blocked_s=blocked)

    def done(f: Future) -> None:
        ok = f.exception() is None
        events.emit("save_done", step=step, location=location, ok=ok, publish_s=time.perf_counter() - started,
                    error=None if ok else repr(f.exception()))

    fut.add_done_callback(done)
    return fut


def resume(
    model: GPT, optimizer: torch.optim.Optimizer, batches: Batches, location: str, rank: int, world: int,
    events: Events, args: argparse.Namespace,
) -> int:
    started = time.perf_counter()
    state = train_state(model, optimizer, batches, 0, rank)  # the template: same keys and shapes
    state["train"] = {"step": -1, "data": {"epoch": -1, "offset": -1, "samples": -1}, "world_size": -1}
    dcp.load(state, storage_reader=UCVolumeReader(location, staging_dir=args.staging_dir))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"][f"rank{rank}"])
    step = int(state["train"]["step"])
    if state["train"]["world_size"] != world:
        raise RuntimeError(f"{location} was saved with world size {state['train']['world_size']}, running {world}")
    if state["train"]["data"] != batches.position(step):
        raise RuntimeError(f"{location}: data position {state['train']['data']} does not match step {step}")
    events.emit("resume", step=step, location=location, data=state["train"]["data"], load_s=time.perf_counter() - started)
    return step


if __name__ == "__main__":
    raise SystemExit(main())
