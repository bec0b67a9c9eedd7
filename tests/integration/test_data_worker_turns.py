"""DataLoader workers across stops and resumes (issue 42, sections 2 and 3).

* A resume is exact at any step, whatever the number of workers: a DataLoader takes batches from its
  workers in turn, so a stop after a number of batches that is not a multiple of the worker count
  leaves the workers mid-turn with different amounts left. The checkpoint keeps each consumer's
  remaining work and each rank's next worker; the resumed loader must hand out, batch by batch, what
  the uninterrupted one did. Checked at every step of a short epoch with 1, 2 and 3 workers, across
  two resumes in a row, and for a new iterator of persistent workers in the same run; on another
  worker count the documented order (an even cut, worker 0 first).
* Workers leave the signals that stop a job to their rank: SIGTERM, SIGINT, SIGHUP, SIGUSR1 sent to a
  worker by another process (as a job-wide stop does) neither kill it nor fail the rank's batches,
  and the workers still end with the loader.

Real forked DataLoader workers; a tiny dataset so that the many loaders stay quick.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from uc_checkpoint.data.intervals import assign, iter_positions
from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.data.state import TrackerState
from uc_checkpoint.data.tracker import DataTracker, ShardSpec

SIZES = (5, 4, 6)  # 15 samples: with 2 or 3 workers some slices end in a short batch
SHARDS = [ShardSpec(f"part-{i}", n) for i, n in enumerate(SIZES)]
INDEX = {s.name: i for i, s in enumerate(SHARDS)}
BATCH = 2


def read_shard(shard: ShardSpec, start: int, end: int):
    """A sample is its own ``(shard index, offset)``."""
    for offset in range(start, end):
        yield (INDEX[shard.name], offset)


class _RecordPid:
    """worker_init_fn: leaves the worker's pid in ``folder`` (so the test can signal it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        (self.folder / f"worker-{worker_id}").write_text(str(os.getpid()))


def make(workers: int, **kwargs: Any) -> tuple[DataTracker, TrackedDataLoader]:
    tracker = DataTracker(SHARDS, seed=3, num_workers=workers)
    loader = TrackedDataLoader(
        TrackedShardDataset(tracker, read_shard), batch_size=BATCH, num_workers=workers, **kwargs
    )
    return tracker, loader


def as_pairs(batch: Any) -> list[tuple[int, int]]:
    shard, offset = batch
    return list(zip(shard.tolist(), offset.tolist()))


def take(it: Any, n: int) -> list[list[tuple[int, int]]]:
    return [as_pairs(next(it)) for _ in range(n)]


def rest(loader: TrackedDataLoader) -> list[list[tuple[int, int]]]:
    return [as_pairs(b) for b in loader]


def resumed(state: dict, workers: int) -> TrackedDataLoader:
    _, loader = make(workers)
    loader.load_state_dict(state)
    return loader


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_resume_at_every_step_hands_out_the_uninterrupted_runs_batches(workers: int) -> None:
    _, loader = make(workers)
    reference = rest(loader)
    assert sorted(p for b in reference for p in b) == [(i, k) for i, n in enumerate(SIZES) for k in range(n)]
    for stop in range(len(reference) + 1):
        _, loader = make(workers)
        it = iter(loader)
        got = take(it, stop)
        state = loader.state_dict()
        del it
        got += rest(resumed(state, workers))
        assert got == reference, f"{workers} workers, resumed after {stop} batches"


@pytest.mark.parametrize("workers", [2, 3])
def test_two_resumes_in_a_row_stay_on_the_uninterrupted_runs_batches(workers: int) -> None:
    _, loader = make(workers)
    reference = rest(loader)
    _, loader = make(workers)
    got = take(iter(loader), 1)
    loader = resumed(loader.state_dict(), workers)
    got += take(iter(loader), 3)  # stops mid-turn again, on a cut that was itself restored
    got += rest(resumed(loader.state_dict(), workers))
    assert got == reference


@pytest.mark.parametrize("workers", [2, 3])
def test_a_new_iterator_of_persistent_workers_goes_on_with_the_turn(workers: int) -> None:
    _, loader = make(workers)
    reference = rest(loader)
    _, loader = make(workers, persistent_workers=True)
    got = take(iter(loader), 1)
    got += take(iter(loader), 2)  # a new pass over the same workers, mid-turn twice
    got += rest(loader)
    assert got == reference


def test_another_worker_count_cuts_the_rest_evenly_worker_0_first() -> None:
    _, loader = make(2)
    it = iter(loader)
    take(it, 3)
    state = loader.state_dict()
    del it
    saved = TrackerState.from_dict(json.loads(state["global_state"]))
    assert saved.consumers is not None and saved.consumers.next_worker == (1,)  # stopped mid-turn
    # The documented order on 3 workers: the remaining work cut evenly, each worker batching its
    # slice, the batches taken from workers 0, 1, 2, 0, ... (a worker that is done drops out).
    queues = [list(iter_positions(piece)) for piece in assign(list(saved.remaining), 3)]
    batches = [[q[i : i + BATCH] for i in range(0, len(q), BATCH)] for q in queues]
    expected = [b[turn] for turn in range(max(map(len, batches))) for b in batches if turn < len(b)]
    assert rest(resumed(state, 3)) == expected


def _worker_pids(folder: Path, workers: int) -> list[int]:
    deadline = time.monotonic() + 60
    while len(list(folder.glob("worker-*"))) < workers:
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    return [int((folder / f"worker-{w}").read_text()) for w in range(workers)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone but not reaped yet
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="workers keep torch's handlers without sigwaitinfo")
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_stop_signals_from_other_processes_leave_the_workers_serving(start_method: str, tmp_path: Path) -> None:
    """Spawned workers too: their interpreter starts threads (a BLAS pool) before the worker's
    init runs, which must not take a signal meant for the worker."""
    _, reference_loader = make(2)
    reference = rest(reference_loader)
    _, loader = make(
        2, worker_init_fn=_RecordPid(tmp_path), persistent_workers=True, multiprocessing_context=start_method
    )
    it = iter(loader)
    got = take(it, 1)
    pids = _worker_pids(tmp_path, 2)
    for sig in ("TERM", "INT", "HUP", "USR1"):
        for pid in pids:  # sent by another process, as a job-wide stop is (kill -TERM -- -<pgid>, Slurm)
            subprocess.run(["kill", f"-{sig}", str(pid)], check=True)
    got += [as_pairs(b) for b in it]  # a worker killed by one would fail this with a RuntimeError
    assert got == reference
    assert all(_alive(pid) for pid in pids)  # persistent: they outlive the pass
    # The rank itself stopping a worker (what the DataLoader does to one that does not exit when
    # told, and multiprocessing at the rank's exit) ends it at once.
    os.kill(pids[0], signal.SIGTERM)
    _wait_gone(pids[:1], "a worker SIGTERMed by its rank")
    del it, loader
    _wait_gone(pids[1:], "a worker of a deleted loader")


def _wait_gone(pids: list[int], what: str) -> None:
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"{what} ({pids}) is still alive"
        time.sleep(0.05)
