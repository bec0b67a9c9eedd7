"""A resumable FSDP2 training job with uc_checkpoint: copy this file, then replace the model and data.

Every rank runs this script under ``torchrun``, which sets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (this script never sets them)::

    torchrun --nproc-per-node=2 examples/train_fsdp.py --checkpoint-root /Volumes/main/ml/ckpt/run1
    # each of NUM_NODES nodes, the scheduler giving NODE_RANK, MASTER_ADDR and MASTER_PORT:
    torchrun --nnodes=$NUM_NODES --node-rank=$NODE_RANK --nproc-per-node=8 \\
        --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT examples/train_fsdp.py --checkpoint-root ...

Relaunched after a preemption or crash (a job retry), it resumes from the newest published
checkpoint under ``--checkpoint-root``: model, optimizer, step and data position (every rank's and
DataLoader worker's), on any number of nodes. SIGTERM, to the agent or to every process of a node,
makes every rank stop at the same step and take a final checkpoint. Checkpoints are serialised to node-local staging (``--staging-dir`` or
``$UC_CHECKPOINT_STAGING_DIR``, default the system temp dir) and uploaded while training goes on.
With ``MLFLOW_TRACKING_URI`` (or ``MLFLOW_RUN_ID`` / ``MLFLOW_EXPERIMENT_NAME``) set, rank 0 logs the
loss every ``--log-every`` steps and the manager logs each checkpoint. See examples/README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import zlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from uc_checkpoint import CheckpointManager, DataTracker, ShardSpec, TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.observability import resume_mlflow_run
from uc_checkpoint.ops.interval import EverySteps

log = logging.getLogger("train_fsdp")
DIM = 32  # features per sample


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-root", required=True, help="/Volumes/<catalog>/<schema>/<volume>/<run>, s3://...")
    p.add_argument(
        "--staging-dir", default=None, help="node-local staging (default $UC_CHECKPOINT_STAGING_DIR or temp)"
    )
    p.add_argument("--steps", type=int, default=200, help="train until this global step")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every this many steps")
    p.add_argument("--keep-last", type=int, default=3, help="published checkpoints to keep")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank and step")
    p.add_argument("--data-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--shards", type=int, default=16, help="synthetic dataset: shards ...")
    p.add_argument("--samples-per-shard", type=int, default=256, help="... of this many samples each")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss logs (log and MLflow)")
    p.add_argument("--timeout-s", type=float, default=600, help="collective timeout: a dead peer fails the job")
    p.add_argument("--samples-log", help="prefix of per-rank JSON-lines logs of the samples each step trained on")
    p.add_argument("--final", help="rank 0 writes the final full model state dict here (torch.save)")
    return p.parse_args()


def read_shard(shard: ShardSpec, start: int, end: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Samples ``start .. end - 1`` of a synthetic shard: ``(x, y, shard number, sample number)``.
    Replace with a reader of your files that seeks to ``start`` (it runs in the DataLoader workers)."""
    index = int(shard.name.rsplit("-", 1)[1])
    for j in range(start, end):
        g = torch.Generator().manual_seed(zlib.crc32(f"{shard.name}/{j}".encode()))
        x = torch.randn(DIM, generator=g)
        yield x, torch.sin(x).sum(0, keepdim=True), index, j


def build_model(device: torch.device, mesh: Any) -> nn.Module:
    """A small MLP; every block and then the root are sharded with FSDP2 over all ranks."""
    blocks = [nn.Sequential(nn.Linear(DIM if i == 0 else 64, 64), nn.GELU()) for i in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(64, 1)).to(device)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def start_mlflow(rank: int, manager: CheckpointManager) -> Any:
    """Rank 0's MLflow module with a run active, or None when MLflow is not configured. A retried
    job continues the run its checkpoint recorded, also where $MLFLOW_RUN_ID names another (a
    launcher that makes a new run per attempt, as Databricks AI Runtime does); a job with no
    checkpoint yet logs to the run $MLFLOW_RUN_ID names, else a new one."""
    configured = any(os.environ.get(v) for v in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"))
    if rank != 0 or not configured:
        return None
    import mlflow

    resume_mlflow_run(manager, prefer="checkpoint")
    return mlflow


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # NCCL for the training's collectives on GPUs; gloo for CPU tensors (async checkpoint saves).
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.use_deterministic_algorithms(True, warn_only=cuda)  # bit-exact resumes (on CUDA also needs cuBLAS settings)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(device, init_device_mesh(device.type, (world,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    shards = [ShardSpec(f"synthetic-{i:04d}", args.samples_per_shard) for i in range(args.shards)]
    tracker = DataTracker(shards, seed=args.seed, rank=rank, world_size=world, num_workers=args.data_workers)
    loader = TrackedDataLoader(
        TrackedShardDataset(tracker, read_shard),
        batch_size=args.batch_size,
        num_workers=args.data_workers,
        persistent_workers=args.data_workers > 0,
    )

    def state(step: int) -> dict[str, Any]:
        # Add each rank's RNG state here if the model uses dropout (see uc_checkpoint/demo/train.py).
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd, "data": loader, "step": step}

    manager = CheckpointManager(
        args.checkpoint_root,
        keep_last=args.keep_last,
        staging_dir=args.staging_dir,
        save_interval=EverySteps(args.save_every),  # or EverySeconds(s), BlockedFraction(f), YoungDaly(...)
    )
    manager.enable_preemption_save()  # SIGTERM sets a flag; the loop saves and stops at a step boundary
    step = 0
    if manager.latest() is not None:  # every rank; rank 0 lists the root and tells the others
        sd = state(0)
        step = manager.load(sd)  # DCP reshards model, optimizer and data to this world size
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        log.info("rank %d: resumed at step %d from %s", rank, step, args.checkpoint_root)
    mlflow = start_mlflow(rank, manager)
    samples_log = open(f"{args.samples_log}-rank{rank}.jsonl", "a") if args.samples_log else None  # noqa: SIM115

    preempted, saved = False, step
    batches = iter(loader)
    while step < args.steps:
        batch = next(batches, None)
        # Every rank needs a full batch: when one runs out, all start the next epoch together.
        full = torch.tensor([int(batch is not None and len(batch[0]) == args.batch_size)], device=device)
        dist.all_reduce(full, op=dist.ReduceOp.MIN)
        if not int(full):
            tracker.start_epoch(tracker.epoch + 1)
            batches = iter(loader)
            continue
        assert batch is not None
        x, y, shard_ids, offsets = batch
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if samples_log is not None:
            samples_log.write(json.dumps({"step": step, "samples": list(zip(shard_ids.tolist(), offsets.tolist()))}))
            samples_log.write("\n")
            samples_log.flush()
        if step % args.log_every == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            log.info("rank %d: step %d loss %.5f", rank, step, float(mean) / world)
            if mlflow is not None:
                mlflow.log_metric("train/loss", float(mean) / world, step=step)
        if manager.preemption_requested():  # a collective: all ranks stop at this step
            manager.save_final(step, state(step), budget_s=60)
            preempted = True
            break
        if manager.should_save(step):
            manager.save(step, state(step))  # async: returns once the state is copied to CPU memory
            saved = step
    if not preempted and saved != step:
        manager.save(step, state(step))  # the end of training is checkpointed too
    manager.wait()  # the last save is published (raises its error, if any)

    if args.final:  # collective: every rank takes part in gathering the full parameters
        full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full_sd, args.final)
    if mlflow is not None:
        mlflow.end_run()
    dist.destroy_process_group()
    # 128 + SIGTERM. torchrun's agent exits 1 either way (examples/README.md, "Exit status").
    return 143 if preempted else 0


if __name__ == "__main__":
    raise SystemExit(main())
