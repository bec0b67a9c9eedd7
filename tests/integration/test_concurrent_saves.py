"""Two jobs saving to one checkpoint location at once (overwrite=True): the newer save publishes, the
older fails with ConcurrentSaveError naming the location and the other save; the published checkpoint
is wholly the newer one's. Each job is a real process (forked, so torch is already imported)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import HeldInWriteStep, wait_for
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.errors import ConcurrentSaveError, rank_error
from uc_checkpoint.format.layout import parse_save_marker
from uc_checkpoint.ops.garbage import collect_garbage
from uc_checkpoint.volumes import LocalVolume

CTX = mp.get_context("fork")


class Gate:
    """A state-dict value whose serialisation (inside the save's write step) waits until the
    location holds ``markers`` save markers (the save claims its location in the background while
    it serialises, and uploads nothing before that), announces itself and then waits, so the other
    job's whole save fits in between."""

    def __init__(
        self, reached: mp.synchronize.Event, release: mp.synchronize.Event, dest: Path, markers: int = 1
    ) -> None:
        self.reached, self.release, self.dest, self.markers = reached, release, dest, markers

    def _claimed(self) -> bool:
        return len([n for n in os.listdir(self.dest) if parse_save_marker(n)]) >= self.markers

    def __getstate__(self) -> dict:
        assert wait_for(self._claimed, timeout=60), f"no {self.markers} save markers at {self.dest}"
        self.reached.set()
        assert self.release.wait(120), "the test never released the first save"
        return {}


def job_state(value: float) -> dict:
    return {"w": torch.full((64, 1024), value), "v": torch.full((8,), value), "meta": {"value": value}}


def job(dest: str, value: float, gate: Gate | None, conn: mp.connection.Connection) -> None:
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
    sd = job_state(value)
    if gate is not None:
        sd["gate"] = gate
    try:
        dcp.save(
            sd, storage_writer=UCVolumeWriter(dest, sync_files=False, options=WriterOptions(file_size_bytes=64 << 10))
        )
        conn.send(None)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send("".join(traceback.format_exception(exc)))


def start(dest: Path, value: float, gate: Gate | None = None):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=job, args=(str(dest), value, gate, child), daemon=True)
    proc.start()
    return proc, parent


def finish(proc, conn, timeout: float = 120) -> str | None:
    assert conn.poll(timeout), "a saving job hung"
    result = conn.recv()
    proc.join(30)
    return result


def load(dest: Path) -> dict:
    out = {"w": torch.zeros(64, 1024), "v": torch.zeros(8), "meta": {"value": -1.0}}
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    return out


@pytest.mark.parametrize("newer_finishes_first", [True, False], ids=["newer-first", "older-first"])
def test_overlapping_saves_one_fails_clearly_and_nothing_mixes(
    tmp_path: Path, staging: Path, newer_finishes_first: bool
) -> None:
    dest = tmp_path / "step_00000001"  # a manager-style location, so gc looks at it
    dcp.save(job_state(0.0), storage_writer=UCVolumeWriter(dest))  # a previous good checkpoint

    reached_a, release_a = CTX.Event(), CTX.Event()
    older = start(dest, 1.0, Gate(reached_a, release_a, dest))
    assert reached_a.wait(120), "the first save never reached its write step"
    if newer_finishes_first:
        # The newer job starts and publishes while the older one is still writing.
        newer = start(dest, 2.0)
        assert finish(*newer) is None
        release_a.set()
        error = finish(*older)
    else:
        # The older job reaches its publish while the newer one is still writing.
        reached_b, release_b = CTX.Event(), CTX.Event()
        newer = start(dest, 2.0, Gate(reached_b, release_b, dest, markers=2))
        assert reached_b.wait(120)
        release_a.set()
        error = finish(*older)
        release_b.set()
        assert finish(*newer) is None

    assert error is not None, "both overlapping saves reported success"
    assert "ConcurrentSaveError" in error and str(dest) in error, error
    assert f"pid {newer[0].pid}" in error, error  # names the other job
    out = load(dest)
    assert torch.equal(out["w"], torch.full((64, 1024), 2.0)) and torch.equal(out["v"], torch.full((8,), 2.0))
    assert out["meta"] == {"value": 2.0}
    names = {p.name for p in dest.iterdir()}
    assert not [n for n in names if parse_save_marker(n)], names  # both jobs removed their markers
    # The losing job's data files stay until gc; gc removes them and nothing the checkpoint needs.
    report = collect_garbage(tmp_path, grace_s=0, include_staging=False)
    assert report.deleted_files and all(".distcp" in f for f in report.deleted_files), report
    assert torch.equal(load(dest)["w"], torch.full((64, 1024), 2.0))


def test_a_killed_saves_marker_does_not_block_the_next_save(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(job_state(0.0), storage_writer=UCVolumeWriter(dest))
    reached, release = CTX.Event(), CTX.Event()
    proc, conn = start(dest, 1.0, Gate(reached, release, dest))
    assert reached.wait(120)
    os.kill(proc.pid, 9)  # preempted mid-save: its marker stays behind
    proc.join(30)
    assert [n for n in os.listdir(dest) if parse_save_marker(n)], "the killed save left no marker to test with"
    dcp.save(job_state(3.0), storage_writer=UCVolumeWriter(dest))  # the resumed job re-saves the step
    assert load(dest)["meta"] == {"value": 3.0}


def rank_local_job(dest: str, store: str, rank: int, conn: mp.connection.Connection) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        sd = {"w": torch.full((32, 32), float(rank)), "meta": {"rank": rank}}
        dcp.save(sd, storage_writer=UCVolumeWriter(dest, sync_files=False), use_collectives=False)
        dist.barrier()
        dist.destroy_process_group()
        conn.send(None)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send("".join(traceback.format_exception(exc)))


def test_rank_local_saves_of_one_job_do_not_conflict(tmp_path: Path, staging: Path) -> None:
    # Without collectives every rank of one job publishes its own __<rank>.metadata at the same
    # location at the same time: their markers live in separate slots and must not clash.
    dest = tmp_path / "ckpt"
    jobs = []
    for rank in (0, 1):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=rank_local_job, args=(str(dest), str(tmp_path / "store"), rank, child), daemon=True)
        proc.start()
        jobs.append((proc, parent))
    assert [finish(*j) for j in jobs] == [None, None]
    names = sorted(os.listdir(dest))
    assert "__0.metadata" in names and "__1.metadata" in names, names
    assert not [n for n in names if parse_save_marker(n)], names


class _ClockSkewVolume(LocalVolume):
    """After writing its claim, makes the other save's marker look newer by the store's clock (a
    store clock of one-second resolution, or two hosts' writes within one tick, give such ties)."""

    def write_tagged(self, name: str, data: bytes) -> str | None:
        tag = super().write_tagged(name, data)
        mine = json.loads(data)["token"]
        for path in Path(self.url).iterdir():
            parsed = parse_save_marker(path.name)
            if parsed is not None and parsed[1] != mine:
                future = time.time() + 3600
                os.utime(path, (future, future))
        return tag


def test_a_marker_clock_that_disagrees_with_the_claims_never_refuses_both(tmp_path: Path, staging: Path) -> None:
    # A claims and is held in its write step; B claims after it (so B publishes), but A's marker
    # looks newer by the clock. Judged by markers too, B would be refused and A (whose claim B
    # replaced) as well: nothing published. Judged by the claim alone, exactly B publishes.
    dest = tmp_path / "ckpt"
    reached, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def save_a() -> None:
        sd = {**job_state(1.0), "held": HeldInWriteStep(reached, release)}
        try:
            dcp.save(
                sd,
                storage_writer=UCVolumeWriter(dest, sync_files=False, options=WriterOptions(file_size_bytes=64 << 10)),
            )
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=save_a)
    thread.start()
    try:
        assert reached.wait(60)
        dcp.save(job_state(2.0), storage_writer=UCVolumeWriter(_ClockSkewVolume(dest), sync_files=False))
    finally:
        release.set()
        thread.join(60)
    assert len(errors) == 1 and isinstance(rank_error(errors[0]), ConcurrentSaveError), errors
    assert torch.equal(load(dest)["w"], torch.full((64, 1024), 2.0))
