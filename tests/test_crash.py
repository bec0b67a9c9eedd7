"""Crash tests: a process that saves in a loop is SIGKILLed at random moments; afterwards every
location either has no ``.metadata`` or loads exactly what one save wrote, and the checkpoints
published before the kill still load.

The saving process is forked from the test process (it already has torch imported, so each round
costs milliseconds, not an interpreter start); the kill is a real SIGKILL of that process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from uc_checkpoint import UCVolumeReader, UCVolumeWriter

ROUNDS = int(os.environ.get("UC_CRASH_ROUNDS", "10"))
KEYS = tuple("abcdefgh")
# Tensors stay below 128 KiB so the allocator reuses heap memory: fresh pages are slow on some VMs.
ROWS = 16


def state_for(i: int) -> dict:
    # Every tensor and the object carry the save number, so a mixed checkpoint cannot hide.
    return {
        **{k: torch.full((ROWS * (n + 1), 128), float(i)) for n, k in enumerate(KEYS)},
        "meta": {"i": i},
    }


def template() -> dict:
    return {**{k: torch.zeros(ROWS * (n + 1), 128) for n, k in enumerate(KEYS)}, "meta": {"i": -1}}


def save_loop(root: str, staging: str, start: int, conn: mp.connection.Connection) -> None:
    torch.set_num_threads(1)
    i = start
    while True:
        sd = state_for(i)
        # Small files: many per save, so kills land between files too. No fsync: a killed process
        # loses nothing the page cache holds (fsync matters for power loss, not tested here).
        for name in (f"step_{i:05d}", "same"):
            writer = UCVolumeWriter(Path(root) / name, staging_dir=staging, file_size_bytes=60_000, sync_files=False)
            dcp.save(sd, storage_writer=writer)
        conn.send(i)
        i += 1


def load_value(path: Path) -> int:
    """Load a checkpoint and return its save number; fail if any part disagrees."""
    out = template()
    dcp.load(out, storage_reader=UCVolumeReader(path))
    i = out["meta"]["i"]
    for k in KEYS:
        assert torch.equal(out[k], torch.full_like(out[k], float(i))), f"{path}: key {k} is not from save {i}"
    return i


@pytest.mark.slow
def test_random_sigkill_never_leaves_a_wrong_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(20261129)
    root = tmp_path / "vol"
    staging = tmp_path / "staging"
    ctx = mp.get_context("fork")
    published: set[int] = set()
    next_i = 0
    killed_mid_save = 0
    for _ in range(ROUNDS):
        parent, child = ctx.Pipe()
        round_start = next_i
        proc = ctx.Process(target=save_loop, args=(str(root), str(staging), next_i, child), daemon=True)
        proc.start()
        # Let it finish at least one save, then kill at a random moment within the next ones.
        assert parent.poll(120), "saving process made no progress"
        done = [parent.recv()]
        time.sleep(rng.uniform(0.0, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        while parent.poll():
            done.append(parent.recv())
        published.update(done)
        last = max(done)
        next_i = last + 2  # never reuse a number that may have been half-written

        # Every step location this round touched either has no .metadata or loads exactly its own save.
        for step_dir in sorted(root.glob("step_*")):
            i = int(step_dir.name.split("_")[1])
            if i < round_start:
                continue
            if (step_dir / ".metadata").exists():
                assert load_value(step_dir) == i
            else:
                assert i not in published, f"{step_dir} lost a published checkpoint"
                killed_mid_save += 1
        # The overwritten location holds one whole save: the last confirmed one or the next.
        same = root / "same"
        assert load_value(same) in (last, last + 1)
        # Every checkpoint confirmed before the kill still loads.
        for i in sorted(published)[-3:]:
            assert load_value(root / f"step_{i:05d}") == i
        # Clean the unpublished leftovers for the next round's counts.
        for step_dir in root.glob("step_*"):
            if not (step_dir / ".metadata").exists():
                for f in step_dir.iterdir():
                    f.unlink()
                step_dir.rmdir()
    assert killed_mid_save > 0, "no kill landed inside a save; the test proves nothing"
