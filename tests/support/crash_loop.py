"""The saving side of the crash tests: a training-like loop that saves through CheckpointManager
(async, retention keep_last=2) and runs garbage collection every few steps, forever, until it is
SIGKILLed. Used forked from the test process (one rank) and under torchrun (two ranks,
tests/scripts/crash_loop_2rank.py).

A probe publishes which phase the loop is in as one byte in a small shared file, so the test can
kill inside each phase on purpose (serialising, uploading, between the last data file and
``.metadata``, retention, garbage collection) instead of hoping a random moment lands there. The
probe wraps a few volume and manager methods in the saving process only; the kill is a real SIGKILL
and everything on disk is real.
"""

from __future__ import annotations

import mmap
import os
import random
import time
from pathlib import Path

import torch

from uc_checkpoint.dcp.options import WriterOptions

PHASES = ("idle", "serialise", "upload", "pre-publish", "retention", "gc")
SERIALISE, UPLOAD, PRE_PUBLISH, RETENTION, GC = range(1, 6)
KEYS = tuple("abcdef")
ROWS = 16  # tensors stay below 128 KiB (fresh pages are slow on some VMs)


def state_for(step: int, rank: int, world_size: int) -> dict:
    """What rank ``rank`` saves at ``step``: shared tensors and one tensor of its own, all carrying
    the step number, so a checkpoint mixing two saves (or two ranks' different saves) cannot hide."""
    sd = {k: torch.full((ROWS * (n + 1), 128), float(step)) for n, k in enumerate(KEYS)}
    sd[f"own{rank}"] = torch.full((ROWS, 64), float(step * 10 + rank))
    sd["meta"] = {"step": step}
    return sd


def template(world_size: int) -> dict:
    sd = {k: torch.zeros(ROWS * (n + 1), 128) for n, k in enumerate(KEYS)}
    for r in range(world_size):
        sd[f"own{r}"] = torch.zeros(ROWS, 64)
    sd["meta"] = {"step": -1}
    return sd


def check_loaded(sd: dict, world_size: int, where: str) -> int:
    """The step a loaded state dict holds; AssertionError naming the key if any part disagrees."""
    step = sd["meta"]["step"]
    for k in KEYS:
        assert torch.equal(sd[k], torch.full_like(sd[k], float(step))), f"{where}: key {k} is not from step {step}"
    for r in range(world_size):
        want = torch.full_like(sd[f"own{r}"], float(step * 10 + r))
        assert torch.equal(sd[f"own{r}"], want), f"{where}: key own{r} is not from step {step}"
    return step


class Phase:
    """One byte in a file: the phase the saving process is in (written by it, read by the test)."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            path.write_bytes(b"\0")
        self._f = open(path, "r+b")  # noqa: SIM115 - lives as long as the process
        self._map = mmap.mmap(self._f.fileno(), 1)

    def set(self, phase: int) -> None:
        self._map[0] = phase

    def get(self) -> int:
        return self._map[0]


def install_probe(phase: Phase, rng: random.Random) -> None:
    """Wrap the volume and manager methods the phases live in (this process only)."""
    from uc_checkpoint.ops import manager as manager_mod
    from uc_checkpoint.volumes.local import LocalVolume

    upload, publish, delete = LocalVolume.upload_file, LocalVolume.publish_bytes, LocalVolume.delete
    prune = manager_mod.CheckpointManager._prune  # what both prune() and the post-publish housekeeping run

    def upload_file(self, *a, **kw):
        phase.set(UPLOAD)
        return upload(self, *a, **kw)

    def publish_bytes(self, name, data, **kw):
        if name == ".metadata":
            # All data files are on the volume and verified; widen the gap before .metadata a little.
            phase.set(PRE_PUBLISH)
            time.sleep(rng.uniform(0.0, 0.004))
        return publish(self, name, data, **kw)

    def slow_delete(self, name):
        time.sleep(0.001)  # deletions of retention and gc take long enough to be hit
        return delete(self, name)

    def probed_prune(self, *a, **kw):
        phase.set(RETENTION)
        try:
            return prune(self, *a, **kw)
        finally:
            phase.set(SERIALISE)

    LocalVolume.upload_file = upload_file
    LocalVolume.publish_bytes = publish_bytes
    LocalVolume.delete = slow_delete
    manager_mod.CheckpointManager._prune = probed_prune


def save_loop(
    root: str, staging: str, start_step: int, phase_file: str, confirmed_file: str | None, seed: int, conn=None
) -> None:
    """Save steps ``start_step, start_step + 1, ...`` until killed. Each confirmed (published) step is
    reported through ``conn`` or appended to ``confirmed_file`` (rank 0)."""
    import torch.distributed as dist

    from uc_checkpoint.ops.garbage import collect_garbage
    from uc_checkpoint.ops.manager import CheckpointManager

    torch.set_num_threads(1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    phase = Phase(Path(f"{phase_file}.{rank}"))
    install_probe(phase, random.Random(seed + rank))
    mgr = CheckpointManager(
        root, keep_last=2, staging_dir=staging, writer=WriterOptions(file_size_bytes=60_000, sync_files=False)
    )
    step = start_step
    while True:
        phase.set(SERIALISE)
        mgr.save(step, state_for(step, rank, world))
        mgr.wait()  # published, and (rank 0) retention done
        if rank == 0:
            if conn is not None:
                conn.send(step)
            if confirmed_file:
                with open(confirmed_file, "a") as f:
                    f.write(f"{step}\n")
            if step % 3 == 0:
                phase.set(GC)
                collect_garbage(root, grace_s=0, staging_dir=staging)
        phase.set(SERIALISE)
        if dist.is_initialized():
            dist.barrier()  # gc on rank 0 runs between saves, never beside one
        step += 1
        os.sched_yield()
