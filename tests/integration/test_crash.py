"""Crash tests: a process that saves in a loop is SIGKILLed; afterwards every location either has
no ``.metadata`` or loads exactly what one save wrote, the checkpoints published before the kill
still load, and ``CheckpointManager.latest()`` is at least the newest confirmed step and loads it.

* the writer alone, killed at random moments (one location re-saved over and over);
* the manager loop (async saves, retention, gc; tests/support/crash_loop.py), killed inside each phase in
  turn: serialising, uploading, between the last data file and ``.metadata``, retention, gc; one
  rank (forked from the test process: torch is already imported, so a round costs milliseconds)
  and two ranks under torchrun.

Counts: ``UC_CRASH_ROUNDS`` (writer and one-rank manager rounds, default 12) and
``UC_CRASH_ROUNDS_2RANK`` (default 2); e.g. ``UC_CRASH_ROUNDS=300 UC_CRASH_ROUNDS_2RANK=30 pytest
tests/integration/test_crash.py`` for a soak. Each test prints its kill counts by phase.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import REPO, wait_for
from tests.support import crash_loop
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.demo.run import kill_process_tree
from uc_checkpoint.ops.catalog import list_steps
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.volumes import LocalVolume

SCRIPT_2RANK = Path(__file__).resolve().parents[1] / "scripts" / "crash_loop_2rank.py"

ROUNDS = int(os.environ.get("UC_CRASH_ROUNDS", "12"))
ROUNDS_2RANK = int(os.environ.get("UC_CRASH_ROUNDS_2RANK", "2"))
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
            writer = UCVolumeWriter(
                Path(root) / name, staging_dir=staging, sync_files=False, options=WriterOptions(file_size_bytes=60_000)
            )
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
def test_random_sigkill_never_leaves_a_wrong_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rng = random.Random(20261129)
    root = tmp_path / "vol"
    staging = tmp_path / "staging"
    ctx = mp.get_context("fork")
    published: set[int] = set()
    next_i = 0
    killed_mid_save = rounds = 0
    # ROUNDS kills, and more (up to 4x) until one lands inside a step save: where kills land depends
    # on how long each phase of a save takes, which changes with the machine and the code.
    while rounds < ROUNDS or (killed_mid_save == 0 and rounds < 4 * ROUNDS):
        rounds += 1
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
    with capsys.disabled():
        print(f"\ncrash test (writer): {rounds} SIGKILLs, {killed_mid_save} inside a save, 0 wrong checkpoints")


# ---------------------------------------------------------------- manager loop, kills by phase

TARGETS = (crash_loop.SERIALISE, crash_loop.UPLOAD, crash_loop.PRE_PUBLISH, crash_loop.RETENTION, crash_loop.GC, None)


def verify_root(root: Path, world_size: int, confirmed: list[int]) -> tuple[int | None, int, int]:
    """Check everything under the manager's root after a kill; returns (latest step, published
    locations, unpublished locations)."""
    published = unpublished = 0
    for info in list_steps(LocalVolume(root)):
        step, name = info.step, info.name
        if not info.published:
            unpublished += 1
            continue
        published += 1
        out = crash_loop.template(world_size)
        dcp.load(out, storage_reader=UCVolumeReader(root / name))
        assert crash_loop.check_loaded(out, world_size, name) == step, f"{name} holds another step's data"
    mgr = CheckpointManager(str(root))
    latest = mgr.latest()
    if confirmed:
        assert latest is not None and latest >= max(confirmed), f"latest() = {latest}, confirmed {max(confirmed)}"
    if latest is not None:
        out = crash_loop.template(world_size)
        assert mgr.load(out) == latest
        assert crash_loop.check_loaded(out, world_size, "latest") == latest
    return latest, published, unpublished


def kill_when(phase: crash_loop.Phase, target: int | None, rng: random.Random, kill) -> int:
    """Wait (up to 30 s) until the saving process is in ``target`` (None: a random moment), kill it,
    and return the phase it was in."""
    if target is None:
        time.sleep(rng.uniform(0.0, 0.5))
    else:
        deadline = time.monotonic() + 30
        while phase.get() != target and time.monotonic() < deadline:
            time.sleep(0.0003)
    hit = phase.get()
    kill()
    return hit


def report(capsys: pytest.CaptureFixture, what: str, rounds: int, hits: Counter, extra: str) -> None:
    by_phase = ", ".join(f"{crash_loop.PHASES[p]} {n}" for p, n in sorted(hits.items()))
    with capsys.disabled():
        print(f"\ncrash test ({what}): {rounds} SIGKILLs ({by_phase}); {extra}; 0 wrong or mixed checkpoints")


@pytest.mark.slow
def test_manager_loop_killed_in_every_phase(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rng = random.Random(20261130)
    root, staging = tmp_path / "vol", tmp_path / "staging"
    phase_file = tmp_path / "phase"
    ctx = mp.get_context("fork")
    hits: Counter = Counter()
    start, unpublished_seen, resumes = 0, 0, 0
    for n in range(ROUNDS):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=crash_loop.save_loop,
            args=(str(root), str(staging), start, str(phase_file), None, rng.randrange(1 << 30), child),
            daemon=True,
        )
        proc.start()
        assert parent.poll(120), "the saving loop made no progress"
        confirmed = [parent.recv()]
        phase = crash_loop.Phase(Path(f"{phase_file}.0"))
        hits[kill_when(phase, TARGETS[n % len(TARGETS)], rng, lambda proc=proc: os.kill(proc.pid, signal.SIGKILL))] += 1
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        while parent.poll():
            confirmed.append(parent.recv())
        latest, _, unpublished = verify_root(root, 1, confirmed)
        unpublished_seen += unpublished
        resumes += latest is not None
        start = 0 if latest is None else latest + 1  # resume like a training job: from latest()
    assert hits[crash_loop.PRE_PUBLISH] and hits[crash_loop.RETENTION] and hits[crash_loop.GC], hits
    report(capsys, "manager, 1 rank", ROUNDS, hits, f"{unpublished_seen} unpublished locations seen, {resumes} resumes")


@pytest.mark.slow
def test_two_rank_manager_loop_killed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rng = random.Random(2026113002)
    root, staging = tmp_path / "vol", tmp_path / "staging"
    phase_file, confirmed_file = tmp_path / "phase", tmp_path / "confirmed"
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    hits: Counter = Counter()
    start = 0
    # The interesting phases first: CI runs only a couple of rounds.
    targets = (
        crash_loop.UPLOAD,
        crash_loop.RETENTION,
        crash_loop.PRE_PUBLISH,
        crash_loop.GC,
        crash_loop.SERIALISE,
        None,
    )
    for n in range(ROUNDS_2RANK):
        confirmed_file.write_text("")
        (tmp_path / "phase.0").unlink(missing_ok=True)
        proc = subprocess.Popen(
            [
                exe,
                "--standalone",
                "--nproc_per_node=2",
                str(SCRIPT_2RANK),
                str(root),
                str(staging),
                str(start),
                str(phase_file),
                str(confirmed_file),
                str(rng.randrange(1 << 30)),
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for(lambda proc=proc: confirmed_file.read_text().strip() or proc.poll() is not None, timeout=300)
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert confirmed_file.read_text().strip(), "the 2-rank saving loop made no progress"
            phase = crash_loop.Phase(tmp_path / "phase.0")
            hits[kill_when(phase, targets[n % len(targets)], rng, lambda proc=proc: kill_process_tree(proc.pid))] += 1
        finally:
            if proc.poll() is None:
                kill_process_tree(proc.pid)
            proc.wait(60)
        confirmed = [int(x) for x in confirmed_file.read_text().split()]
        latest, _, _ = verify_root(root, 2, confirmed)
        start = 0 if latest is None else latest + 1
    report(capsys, "manager, 2 ranks", ROUNDS_2RANK, hits, f"resumed up to step {start}")
