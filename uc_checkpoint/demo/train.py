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
from collections.abc import Iterator
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

from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.data.readers import TokenReader
from uc_checkpoint.data.tracker import DataTracker, ShardSpec
from uc_checkpoint.dcp.reader import UCVolumeReader
from uc_checkpoint.dcp.writer import UCVolumeWriter
from uc_checkpoint.demo.data import ShardSet
from uc_checkpoint.demo.model import GPT, GPTConfig, shard_model
from uc_checkpoint.format.layout import checkpoint_name
from uc_checkpoint.ops import catalog
from uc_checkpoint.volumes import open_volume


class Events:
    """Rank 0's event log: one JSON object per line, flushed at once."""

    def __init__(self, path: str | None, rank: int) -> None:
        self._file = open(path, "a", encoding="utf-8") if path and rank == 0 else None  # noqa: SIM115

    def emit(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")
            self._file.flush()


class DemoShardReader:
    """``read_shard`` for the tracker: the demo's byte shards read as flat token files of uint8
    (:class:`~uc_checkpoint.data.readers.TokenReader`: sample ``j`` is the ``j``-th window of
    ``seq_len + 1`` bytes, from a memory map in the data-loader worker: a seek, never a scan).
    Yields ``(window, shard index, j)`` so that the training loop can log which samples it
    consumed. ``specs`` are the shards as the tracker takes them (names relative to the root,
    sample counts, content fingerprints)."""

    def __init__(self, shards: ShardSet, seq_len: int) -> None:
        self.tokens = TokenReader(shards.root, seq_len, dtype="uint8", files=[info.name for info in shards.shards])
        self.specs = self.tokens.shards()
        self.index = {spec.name: i for i, spec in enumerate(self.specs)}

    def __call__(self, shard: ShardSpec, start: int, end: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        i = self.index[shard.name]
        for j, window in zip(range(start, end), self.tokens(shard, start, end)):
            yield torch.from_numpy(window), i, j


class SampleLog:
    """Each rank's record of the samples it trained on: one JSON line per step,
    ``{"step": s, "samples": [[shard, j], ...]}``, so the orchestrator can check exactly-once."""

    def __init__(self, prefix: str | None, rank: int) -> None:
        self._file = open(f"{prefix}-rank{rank}.jsonl", "a", encoding="utf-8") if prefix else None  # noqa: SIM115

    def write(self, step: int, shard: torch.Tensor, j: torch.Tensor) -> None:
        if self._file is not None:
            pairs = [[int(a), int(b)] for a, b in zip(shard.tolist(), j.tolist())]
            self._file.write(json.dumps({"step": step, "samples": pairs}) + "\n")
            self._file.flush()


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
    p.add_argument("--data-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--samples-log", help="prefix of the per-rank logs of consumed samples")
    p.add_argument("--final-data", help="where rank 0 writes the final data-tracker state (JSON)")
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
    reader = DemoShardReader(shards, config.seq_len)
    specs = reader.specs
    tracker = DataTracker(specs, seed=args.seed, rank=rank, world_size=world, num_workers=args.data_workers)
    loader = TrackedDataLoader(
        TrackedShardDataset(tracker, reader),
        batch_size=args.batch_size,
        num_workers=args.data_workers,
        persistent_workers=args.data_workers > 0,
    )
    samples_log = SampleLog(args.samples_log, rank)
    torch.manual_seed(args.seed + 1 + rank)  # dropout differs per rank, and is checkpointed

    start_step = 0
    volume = open_volume(args.volume) if args.volume else None
    if volume is not None:
        # The newest intact checkpoint, as CheckpointManager.latest() finds it: a published one
        # with a missing or short file is skipped, not resumed from.
        newest = catalog.latest(volume) if rank == 0 else None
        found = None if newest is None else (newest.step, newest.name)
        box: list[tuple[int, str] | None] = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
        if found is not None:
            start_step = resume(model, optimizer, loader, volume.child(found[1]).url, rank, world, events, args)
    events.emit("start", step=start_step, world_size=world, params=sum(p.numel() for p in model.parameters()))

    pending: Future | None = None
    step = start_step
    batches = iter(loader)
    while step < args.steps:
        batch = next(batches, None)
        # Lock-step epochs: every rank needs a full batch. When any rank runs out, all ranks start the
        # next epoch together (the tracker drops, and warns about, the few samples left this epoch).
        full = torch.tensor([int(batch is not None and len(batch[0]) == args.batch_size)])
        dist.all_reduce(full, op=dist.ReduceOp.MIN)
        if not int(full):
            tracker.start_epoch(tracker.epoch + 1)
            events.emit("epoch", epoch=tracker.epoch, step=step)
            batches = iter(loader)
            continue
        assert batch is not None  # every rank had a full batch
        x, shard_ids, offsets = batch
        _, loss = model(x[:, :-1], x[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        samples_log.write(step, shard_ids, offsets)
        loss_value = loss.detach().clone()
        dist.all_reduce(loss_value)
        events.emit("step", step=step, loss=float(loss_value) / world)
        if volume is not None and step % args.save_every == 0:
            if pending is not None:
                pending.result()  # one save in flight at a time
            pending = save(
                model, optimizer, loader, step, volume.child(checkpoint_name(step)).url, rank, ckpt_group, events, args
            )
    if pending is not None:
        pending.result()

    final_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    data_state = loader.state_dict()  # collective: every rank
    if rank == 0 and args.final_data:
        Path(args.final_data).write_text(data_state["global_state"])
    if rank == 0:
        tmp = Path(args.final + ".tmp")
        torch.save(final_sd, tmp)
        os.replace(tmp, args.final)
    events.emit("done", step=step)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def train_state(
    model: GPT, optimizer: torch.optim.Optimizer, loader: TrackedDataLoader, step: int, rank: int, world: int
) -> dict[str, Any]:
    """The checkpointed state: model and optimiser (DTensor shards), this rank's RNG under a key of
    its own, the step, and the data tracker (a Stateful: the data position of every rank and
    DataLoader worker, gathered when DCP calls its state_dict)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "rng": {f"rank{rank}": torch.get_rng_state()},
        "train": {"step": step, "world_size": world},
        "data": loader,
    }


def save(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    loader: TrackedDataLoader,
    step: int,
    location: str,
    rank: int,
    group: dist.ProcessGroup,
    events: Events,
    args: argparse.Namespace,
) -> Future:
    started = time.perf_counter()
    mode = AsyncCheckpointerType.PROCESS if args.async_mode == "process" else AsyncCheckpointerType.THREAD
    fut: Future = dcp.async_save(  # type: ignore[assignment]  # a Future: UCVolumeWriter stages synchronously
        train_state(model, optimizer, loader, step, rank, dist.get_world_size()),
        storage_writer=UCVolumeWriter(location, staging_dir=args.staging_dir),
        process_group=group,
        async_checkpointer_type=mode,
    )
    blocked = time.perf_counter() - started
    events.emit("save_start", step=step, location=location, blocked_s=blocked)

    def done(f: Future) -> None:
        ok = f.exception() is None
        events.emit(
            "save_done",
            step=step,
            location=location,
            ok=ok,
            publish_s=time.perf_counter() - started,
            error=None if ok else repr(f.exception()),
        )

    fut.add_done_callback(done)
    return fut


def resume(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    loader: TrackedDataLoader,
    location: str,
    rank: int,
    world: int,
    events: Events,
    args: argparse.Namespace,
) -> int:
    """Load the checkpoint at ``location`` into this run, whatever world size saved it: DCP reshards
    the model and optimiser, the tracker reshards the remaining data."""
    started = time.perf_counter()
    state = train_state(model, optimizer, loader, 0, rank, world)  # the template: same keys and shapes
    state["train"] = {"step": -1, "world_size": -1}
    saved_keys = UCVolumeReader(location, staging_dir=args.staging_dir).read_metadata().state_dict_metadata
    if f"rng.rank{rank}" not in saved_keys:
        # A rank the saving run did not have (the world grew): it keeps its fresh dropout stream.
        del state["rng"]
    dcp.load(state, storage_reader=UCVolumeReader(location, staging_dir=args.staging_dir))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if "rng" in state:
        torch.set_rng_state(state["rng"][f"rank{rank}"])
    step = int(state["train"]["step"])
    events.emit(
        "resume",
        step=step,
        location=location,
        load_s=time.perf_counter() - started,
        saved_world_size=state["train"]["world_size"],
        world_size=world,
        data=loader.tracker.resume_summary(),
    )
    return step


if __name__ == "__main__":
    raise SystemExit(main())
