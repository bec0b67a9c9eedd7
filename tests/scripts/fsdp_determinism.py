"""Check that FSDP2 training of the demo GPT on CPU is bit-deterministic and resumable.

Run with two ranks::

    timeout 300 .venv/bin/torchrun --standalone --nproc_per_node=2 \
        tests/scripts/fsdp_determinism.py OUTDIR

Four runs share one process group (gloo) and one CPU device mesh:

A  seed the model, shard it with FSDP2, train 6 AdamW steps on real shard samples (each rank its
   own samples, dropout active); after step 3 save ``{"model", "optim"}`` from
   ``get_state_dict`` plus each rank's ``torch.get_rng_state()`` and the step number with stock
   ``dcp.save``.
A2 the same 6 steps again from scratch, without saving: must equal A bit for bit (determinism).
B  a fresh model and optimizer from a different seed; ``dcp.load`` + ``set_state_dict`` from
   the step-3 checkpoint, restore the RNG, train steps 4..6: must equal A bit for bit (resume).
C  as B but without restoring the RNG: must differ from A, which shows that dropout (and so the
   RNG in the checkpoint) matters and the comparison can fail.

Compared: the full (unsharded) model state dict, the full optimizer state dict and the losses
of steps 4..6. Rank 0 prints PASS or FAIL and writes ``OUTDIR/result.json``; the exit status is
non-zero on FAIL on every rank.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

try:
    from uc_checkpoint.demo.data import ShardReader, ShardSet, build_shards, step_sample_ids
    from uc_checkpoint.demo.model import GPT, GPTConfig, shard_model
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from uc_checkpoint.demo.data import ShardReader, ShardSet, build_shards, step_sample_ids
    from uc_checkpoint.demo.model import GPT, GPTConfig, shard_model

TOTAL_STEPS = 6
SAVE_AFTER = 3
BATCH = 8
MODEL_SEED = 0
OTHER_MODEL_SEED = 12345
DATA_SEED = 0
LR = 1e-3
DATA_BYTES = 4 << 20

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class RunResult:
    """What one run leaves behind for comparison (full states only on rank 0)."""

    losses: dict[int, float] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)
    model_state: dict[str, Any] = field(default_factory=dict)
    optim_state: dict[str, Any] = field(default_factory=dict)
    snapshot_at_save: dict[str, Any] = field(default_factory=dict)


class Batches:
    """Deterministic per-(step, rank) batches of real shard samples."""

    def __init__(self, shards: ShardSet, seq_len: int, rank: int, world: int, batch: int) -> None:
        self.shards, self.seq_len, self.rank, self.world = shards, seq_len, rank, world
        self.batch = batch
        self.readers = [ShardReader(shards.path(i), seq_len) for i in range(len(shards.shards))]
        self.num_samples = shards.num_samples(seq_len)

    def get(self, step: int) -> torch.Tensor:
        ids = step_sample_ids(
            step, self.rank, self.world, self.batch, self.num_samples, DATA_SEED
        )
        rows = []
        for sample_id in ids:
            shard, j = self.shards.locate(sample_id, self.seq_len)
            rows.append(self.readers[shard][j])
        return torch.stack(rows)


_START = time.perf_counter()


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - _START:6.1f}s] {msg}", flush=True)


def build(mesh: DeviceMesh, seed: int) -> tuple[GPT, torch.optim.Optimizer]:
    # Every rank must use the same seed: FSDP2 keeps each rank's slice of its *local* init and
    # does not broadcast from rank 0 (there is no sync_module_states in fully_shard).
    torch.manual_seed(seed)
    model = shard_model(GPT(GPTConfig.demo()), mesh)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, optimizer


def train_step(model: GPT, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    _, loss = model(batch[:, :-1], batch[:, 1:])
    assert loss is not None
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # Each rank's loss is local; average so every rank reports the same number.
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)
    return reduced.item() / dist.get_world_size()


def train(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    steps: range,
    result: RunResult,
    on_step_done: Any = None,
) -> None:
    for step in steps:  # 0-based; printed 1-based
        batch = batches.get(step)
        t0, c0 = time.perf_counter(), time.process_time()
        result.losses[step + 1] = train_step(model, optimizer, batch)
        result.step_seconds.append(time.perf_counter() - t0)
        result.step_cpu_seconds.append(time.process_time() - c0)
        log(f"  step {step + 1}: loss {result.losses[step + 1]:.4f} "
            f"{result.step_seconds[-1]:.2f}s wall {result.step_cpu_seconds[-1]:.2f}s cpu")
        if on_step_done is not None:
            on_step_done(step + 1)


def finish(model: GPT, optimizer: torch.optim.Optimizer, result: RunResult) -> RunResult:
    # Collective on all ranks; with cpu_offload only rank 0 receives the tensors.
    result.model_state = get_model_state_dict(model, options=FULL)
    result.optim_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    return result


def rng_key(rank: int) -> str:
    return f"rank{rank}"


def run_uninterrupted(
    mesh: DeviceMesh, batches: Batches, ckpt_dir: Path | None
) -> RunResult:
    result = RunResult()
    model, optimizer = build(mesh, MODEL_SEED)
    rank = dist.get_rank()
    # Per-rank dropout streams, fixed after model init so they do not depend on init order.
    torch.manual_seed(1000 + rank)

    def maybe_save(done: int) -> None:
        if ckpt_dir is None or done != SAVE_AFTER:
            return
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "rng": {rng_key(rank): torch.get_rng_state()},
            "step": done,
        }
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(ckpt_dir))
        log(f"saved step {done} in {time.perf_counter() - t0:.2f}s to {ckpt_dir}")
        result.snapshot_at_save = get_model_state_dict(model, options=FULL)

    train(model, optimizer, batches, range(TOTAL_STEPS), result, maybe_save)
    return finish(model, optimizer, result)


def run_resumed(
    mesh: DeviceMesh, batches: Batches, ckpt_dir: Path, restore_rng: bool
) -> tuple[RunResult, bool]:
    result = RunResult()
    rank = dist.get_rank()
    model, optimizer = build(mesh, OTHER_MODEL_SEED)
    # get_state_dict on a fresh optimizer runs one lr=0 step with zero grads so that exp_avg,
    # exp_avg_sq and step exist and DCP has tensors to load into.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {
        "model": model_sd,
        "optim": optim_sd,
        "rng": {rng_key(rank): torch.empty_like(torch.get_rng_state())},
        "step": -1,
    }
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=str(ckpt_dir))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    log(f"loaded step {state['step']} in {time.perf_counter() - t0:.2f}s")
    step_ok = state["step"] == SAVE_AFTER
    loaded_full = get_model_state_dict(model, options=FULL)
    result.snapshot_at_save = loaded_full
    if restore_rng:
        torch.set_rng_state(state["rng"][rng_key(rank)])
    else:
        torch.manual_seed(999_999 + rank)
    train(model, optimizer, batches, range(SAVE_AFTER, TOTAL_STEPS), result)
    return finish(model, optimizer, result), step_ok


def tensors_equal(a: Any, b: Any, path: str, problems: list[str]) -> None:
    """Recursively compare nested dicts/lists of tensors and scalars, exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            problems.append(f"{path}: tensor vs {type(b).__name__}")
        elif a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            problems.append(f"{path}: tensors differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            problems.append(f"{path}: keys differ {sorted(set(a) ^ set(b), key=str)[:5]}")
        for key in set(a) & set(b):
            tensors_equal(a[key], b[key], f"{path}.{key}", problems)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            problems.append(f"{path}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b)):
            tensors_equal(x, y, f"{path}[{i}]", problems)
    elif a != b:
        problems.append(f"{path}: {a!r} != {b!r}")


def compare(name: str, ref: RunResult, other: RunResult, steps: list[int]) -> list[str]:
    problems: list[str] = []
    tensors_equal(ref.model_state, other.model_state, f"{name}.model", problems)
    tensors_equal(ref.optim_state, other.optim_state, f"{name}.optim", problems)
    for step in steps:
        if ref.losses.get(step) != other.losses.get(step):
            problems.append(f"{name}: loss at step {step} {ref.losses.get(step)} != "
                            f"{other.losses.get(step)}")
    return problems


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="directory for data, checkpoint and result")
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per rank per step")
    args = parser.parse_args(argv[1:])
    out: Path = args.outdir
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log(f"started: world {world}, batch {args.batch} per rank, torch {torch.__version__}")
    try:
        mesh = init_device_mesh("cpu", (world,))
        ckpt = out / f"ckpt_step{SAVE_AFTER}"
        if rank == 0:
            build_shards(out / "data", num_shards=8, max_bytes=DATA_BYTES)
            shutil.rmtree(ckpt, ignore_errors=True)  # a leftover from an earlier run
        dist.barrier()
        shards = ShardSet.load(out / "data")
        log(f"data ready: {shards.total_bytes} bytes in {len(shards.shards)} shards")
        batches = Batches(shards, GPTConfig.demo().seq_len, rank, world, args.batch)

        log("run A: uninterrupted, saving after step 3")
        a = run_uninterrupted(mesh, batches, ckpt)
        log("run A2: uninterrupted again")
        a2 = run_uninterrupted(mesh, batches, None)
        log("run B: fresh seed, load step 3, restore RNG, steps 4..6")
        b, b_step_ok = run_resumed(mesh, batches, ckpt, restore_rng=True)
        log("run C (control): load step 3 without restoring the RNG")
        c, _ = run_resumed(mesh, batches, ckpt, restore_rng=False)

        verdict = torch.zeros(1, dtype=torch.int64)
        summary: dict[str, Any] = {}
        if rank == 0:
            later = list(range(SAVE_AFTER + 1, TOTAL_STEPS + 1))
            problems = compare("A2", a, a2, list(range(1, TOTAL_STEPS + 1)))
            problems += compare("B", a, b, later)
            snap: list[str] = []
            tensors_equal(a.snapshot_at_save, b.snapshot_at_save, "B.loaded", snap)
            problems += snap
            if not b_step_ok:
                problems.append("B: 'step' in the checkpoint did not load as 3")
            control = compare("C", a, c, later)
            if not control:
                problems.append("C: without the RNG the result is still identical, so the "
                                "check has no power (is dropout active?)")
            timing = a.step_seconds[1:]
            cpu = a.step_cpu_seconds[1:]
            summary = {
                "verdict": "PASS" if not problems else "FAIL",
                "problems": problems[:50],
                "control_differences": len(control),
                "losses_A": a.losses,
                "losses_B": b.losses,
                "losses_C": c.losses,
                "step_seconds_median": statistics.median(timing),
                "step_seconds_min": min(timing),
                "step_cpu_seconds_median": statistics.median(cpu),
                "checkpoint_bytes": dir_bytes(ckpt),
                "checkpoint_files": sorted(p.name for p in ckpt.iterdir()),
                "model_tensors": len(a.model_state),
                "world_size": world,
                "batch_per_rank": args.batch,
                "threads": torch.get_num_threads(),
            }
            (out / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
            for line in problems[:20]:
                print("  problem:", line)
            print(f"losses A: {a.losses}")
            print(f"losses B: {b.losses}")
            print(f"losses C: {c.losses} (control, should differ)")
            print(f"step time (rank 0, steps 2..6 of A): median "
                  f"{summary['step_seconds_median']:.3f}s wall, "
                  f"min {summary['step_seconds_min']:.3f}s wall, "
                  f"median {summary['step_cpu_seconds_median']:.3f}s cpu")
            print(f"checkpoint: {summary['checkpoint_bytes']} bytes in "
                  f"{len(summary['checkpoint_files'])} files")
            verdict[0] = 0 if not problems else 1
        dist.broadcast(verdict, src=0)
        ok = int(verdict.item()) == 0
        if rank == 0:
            print("PASS" if ok else "FAIL", flush=True)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
