"""The save / publish / resume cycle under real conditions (issue 13):

- a training loop's collectives and the manager's foreground agreement never pair with the
  collectives of a save running in the background (2 ranks under torchrun, both manager
  configurations, THREAD and PROCESS saves);
- a save in flight when the script ends is finished before the interpreter shuts its thread pools
  (writer alone and manager, THREAD and PROCESS, local and S3), and a failing one is reported;
- a publish is confirmed by content before anything is deleted (a mount that loses a rename);
- one save (load) per writer (reader) object: a second one while it is in flight is refused at
  once; overlapping saves (loads) through separate objects each keep their own state.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import SCRIPTS, run_script, torchrun
from tests.support.s3_fixtures import s3_client
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import ReaderOptions, WriterOptions
from uc_checkpoint.errors import ConcurrentSaveError, TransferError, rank_error
from uc_checkpoint.volumes import local as local_volume
from uc_checkpoint.volumes.local import LocalVolume

# ---------------------------------------------------------------------------------------------
# 1. collectives


@pytest.mark.slow
@pytest.mark.parametrize(
    ("group", "mode", "steps"), [("own", "thread", 24), ("default", "thread", 24), ("default", "process", 12)]
)
def test_training_collectives_never_pair_with_a_background_save(
    tmp_path: Path, group: str, mode: str, steps: int
) -> None:
    # Without the manager's own groups this loop hung at step 1 (own) or 2 (default) until the
    # torchrun timeout: every step's save is in flight while the loop issues collectives.
    root = tmp_path / "root"
    proc = torchrun(SCRIPTS / "manager_collectives_loop.py", str(root), group, str(steps), mode, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "RANK 0 OK" in proc.stdout and "RANK 1 OK" in proc.stdout, out[-5000:]
    published = sorted(p.parent.name for p in root.glob("step_*/.metadata"))
    assert published == [f"step_{s:08d}" for s in range(1, steps + 1)]


# ---------------------------------------------------------------------------------------------
# 2. interpreter exit


def _exit_script(kind: str, mode: str, location: str, tmp_path: Path, env: dict | None = None) -> Any:
    return run_script(
        [sys.executable, str(SCRIPTS / "exit_with_save_in_flight.py"), kind, mode, location, str(tmp_path / "pg")],
        timeout=240,
        env=env,
    )


def _load_back(location: str) -> dict[str, torch.Tensor]:
    target = {"w": torch.zeros(1000), "big": torch.zeros(3_000_000)}
    dcp.load(target, storage_reader=UCVolumeReader(location), no_dist=True)
    return target


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "mode"),
    [
        ("writer", "thread"),
        ("writer", "process"),
        ("manager", "thread"),
        ("manager", "process"),
        ("stager", "thread"),
        ("late", "thread"),
    ],
)
def test_a_save_in_flight_at_exit_is_finished(tmp_path: Path, kind: str, mode: str) -> None:
    location = tmp_path / "vol"
    proc = _exit_script(kind, mode, str(location), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SCRIPT END" in proc.stdout
    ckpt = location / "step_00000005" if kind == "manager" else location
    assert (ckpt / ".metadata").is_file(), (sorted(p.name for p in ckpt.iterdir()), proc.stderr[-3000:])
    assert not list(ckpt.glob(".uc-save-*")), "the save marker must be gone after a publish"
    loaded = _load_back(str(ckpt))
    assert torch.equal(loaded["w"], torch.full((1000,), 7.0))
    assert torch.equal(loaded["big"], torch.arange(3_000_000, dtype=torch.float32))
    if kind == "manager":
        assert (location / "latest").is_file()  # the housekeeping after the publish ran too


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["writer", "manager"])
def test_a_save_in_flight_at_exit_reaches_s3(tmp_path: Path, s3_server: str, s3_bucket: str, kind: str) -> None:
    # S3 uploads go through boto3's transfer manager, itself a ThreadPoolExecutor.
    root = f"s3://{s3_bucket}/exit/{kind}"
    proc = _exit_script(kind, "thread", root, tmp_path, env={"AWS_ENDPOINT_URL": s3_server})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = f"{root}/step_00000005" if kind == "manager" else root
    keys = [
        o["Key"] for o in s3_client(s3_server).list_objects_v2(Bucket=s3_bucket, Prefix="exit/").get("Contents", [])
    ]
    assert any(k.endswith("/.metadata") for k in keys), keys
    old_endpoint = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = s3_server
    try:
        loaded = _load_back(ckpt)
    finally:
        if old_endpoint is None:
            os.environ.pop("AWS_ENDPOINT_URL")
        else:
            os.environ["AWS_ENDPOINT_URL"] = old_endpoint
    assert torch.equal(loaded["big"], torch.arange(3_000_000, dtype=torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["writer", "manager"])
def test_a_save_failing_at_exit_is_reported_on_stderr(tmp_path: Path, kind: str) -> None:
    # The staging root is a file: the save fails in its background thread after the script ended.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    location = tmp_path / "vol"
    proc = _exit_script(kind, "thread", str(location), tmp_path, env={"UC_CHECKPOINT_STAGING_DIR": str(blocker)})
    assert "SCRIPT END" in proc.stdout
    assert "failed" in proc.stderr and "StagingError" in proc.stderr and str(location) in proc.stderr, proc.stderr[
        -3000:
    ]
    assert not list(location.rglob(".metadata"))


# ---------------------------------------------------------------------------------------------
# 5. publish confirmed by content


@pytest.fixture
def lossy_rename(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``os.replace`` onto a ``.metadata`` reports success and loses the file (seen on a real
    rclone mount); returns the list of renames it dropped."""
    real = os.replace
    dropped: list[str] = []

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == ".metadata":
            os.unlink(src)
            dropped.append(str(dst))
            return
        real(src, dst)

    monkeypatch.setattr(local_volume.os, "replace", replace)
    return dropped


def _sd(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((4096,), value), "b": torch.arange(100.0) + value}


def _load(location: Path | str) -> dict[str, torch.Tensor]:
    target = {"a": torch.zeros(4096), "b": torch.zeros(100)}
    dcp.load(target, storage_reader=UCVolumeReader(location), no_dist=True)
    return target


def _save_error(sd: dict, writer: UCVolumeWriter) -> BaseException:
    with pytest.raises(BaseException) as info:
        dcp.save(sd, storage_writer=writer, no_dist=True)
    return rank_error(info.value)


def test_a_resave_whose_metadata_is_lost_keeps_the_old_checkpoint(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    loc = tmp_path / "ckpt"
    dcp.save(_sd(1.0), storage_writer=UCVolumeWriter(loc), no_dist=True)
    old_files = sorted(p.name for p in loc.iterdir())
    request.getfixturevalue("lossy_rename")  # from here on the mount loses renames of .metadata
    monkeypatch = request.getfixturevalue("monkeypatch")
    err = _save_error(_sd(2.0), UCVolumeWriter(loc))
    assert isinstance(err, TransferError), err
    assert str(loc / ".metadata") in str(err) and "Nothing was deleted" in str(err), err
    monkeypatch.undo()
    still = sorted(p.name for p in loc.iterdir() if not p.name.startswith(".uc-save-"))
    assert set(old_files) <= set(still), (old_files, still)  # every file of the old checkpoint is kept
    assert torch.equal(_load(loc)["a"], torch.full((4096,), 1.0))


@pytest.fixture
def rename_keeps_target(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``os.replace`` onto an existing file reports success and keeps the old file (seen on real
    rclone mounts); onto a new name it works. Returns the targets it kept."""
    real = os.replace
    kept: list[str] = []

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).exists():
            os.unlink(src)
            kept.append(Path(dst).name)
            return
        real(src, dst)

    monkeypatch.setattr(local_volume.os, "replace", replace)
    return kept


@pytest.mark.parametrize("spelling", ["path", "file-url"])
def test_a_claim_the_mount_did_not_keep_is_named_as_such_not_as_another_save(
    tmp_path: Path, request: pytest.FixtureRequest, spelling: str
) -> None:
    loc = tmp_path / "ckpt"
    target: Path | str = loc if spelling == "path" else f"file://{loc}"
    dcp.save(_sd(1.0), storage_writer=UCVolumeWriter(target), no_dist=True)
    claim_before = (loc / ".uc-claim").read_bytes()
    kept = request.getfixturevalue("rename_keeps_target")
    err = _save_error(_sd(2.0), UCVolumeWriter(target))
    assert ".uc-claim" in kept
    assert isinstance(err, TransferError) and not isinstance(err, ConcurrentSaveError), repr(err)
    assert f"{loc / '.uc-claim'} was written by this save" in str(err), err
    assert "the volume did not keep the write" in str(err) and "no other save is involved" in str(err), err
    assert f"pid {os.getpid()}" in str(err)  # the earlier save's claim, named as such
    request.getfixturevalue("monkeypatch").undo()
    assert (loc / ".uc-claim").read_bytes() == claim_before
    assert torch.equal(_load(loc)["a"], torch.full((4096,), 1.0))  # the old checkpoint, untouched
    dcp.save(_sd(3.0), storage_writer=UCVolumeWriter(target), no_dist=True)  # a sound mount again
    assert torch.equal(_load(loc)["a"], torch.full((4096,), 3.0))


def test_an_fsspec_claim_the_store_did_not_keep_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    url = f"memory://lifecycle-kept-claim-{os.getpid()}/ckpt"
    dcp.save(_sd(4.0), storage_writer=UCVolumeWriter(url), no_dist=True)
    fs = fsspec.filesystem("memory")
    real_pipe = type(fs).pipe_file

    def keeps_old(self: Any, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        if self.exists(path) and not path.endswith(".distcp"):
            return  # answers as if written, keeps what was there
        real_pipe(self, path, value, *args, **kwargs)

    monkeypatch.setattr(type(fs), "pipe_file", keeps_old)
    err = _save_error(_sd(5.0), UCVolumeWriter(url))
    monkeypatch.undo()
    assert isinstance(err, TransferError) and not isinstance(err, ConcurrentSaveError), repr(err)
    assert "/ckpt/.uc-claim was written by this save" in str(err) and "did not keep the write" in str(err), err
    assert torch.equal(_load(url)["a"], torch.full((4096,), 4.0))
    fs.rm(url.removeprefix("memory://").rsplit("/", 1)[0], recursive=True)


def test_a_first_publish_that_is_lost_is_an_error(tmp_path: Path, lossy_rename: list[str]) -> None:
    loc = tmp_path / "first"
    err = _save_error(_sd(3.0), UCVolumeWriter(loc))
    assert isinstance(err, TransferError) and str(loc / ".metadata") in str(err), err
    assert lossy_rename == [str(loc / ".metadata")]
    assert not (loc / ".metadata").exists()


def test_an_fsspec_publish_that_is_lost_keeps_the_old_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    url = "memory://lifecycle-lost-publish/ckpt"
    dcp.save(_sd(4.0), storage_writer=UCVolumeWriter(url), no_dist=True)
    fs = fsspec.filesystem("memory")
    real_pipe = type(fs).pipe_file

    def lossy_pipe(self: Any, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        if path.endswith("/.metadata"):
            # The store keeps the old object but answers as if the new one had landed: same size.
            old = self.cat_file(path)
            real_pipe(self, path, old[: len(value)].ljust(len(value), b"\0"), *args, **kwargs)
            return
        real_pipe(self, path, value, *args, **kwargs)

    monkeypatch.setattr(type(fs), "pipe_file", lossy_pipe)
    err = _save_error(_sd(5.0), UCVolumeWriter(url))
    assert isinstance(err, TransferError) and "the volume lost the write" in str(err), err
    monkeypatch.undo()
    names = fs.ls("/lifecycle-lost-publish/ckpt", detail=False)
    assert sum(1 for n in names if n.endswith(".distcp")) >= 2  # old and new data files both kept
    fs.rm("/lifecycle-lost-publish", recursive=True)


# ---------------------------------------------------------------------------------------------
# 8. one save per writer object, one load per reader object; overlapping ones through several


class _Rendezvous:
    """Holds the first upload (or download) of each of two saves (loads) until both have reached it,
    so they are certainly in flight at the same time."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
        self.barrier = threading.Barrier(2, timeout=30)
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        real = getattr(LocalVolume, method)

        def held(volume: LocalVolume, *args: Any, **kwargs: Any) -> Any:
            with self.lock:
                first = volume.url not in self.seen
                self.seen.add(volume.url)
            if first:
                self.barrier.wait()
            return real(volume, *args, **kwargs)

        monkeypatch.setattr(LocalVolume, method, held)


def _big(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((64, 1024), value + i) for i in range(8)}


ONE_WRITER_PER_SAVE = "one writer object serves one save at a time"


def test_two_writers_overlapping_async_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _Rendezvous(monkeypatch, "upload_file")
    options = WriterOptions(file_size_bytes=256 << 10)
    a, b = tmp_path / "A", tmp_path / "B"
    fut_a = dcp.async_save(_big(1.0), storage_writer=UCVolumeWriter(a, options=options), no_dist=True)
    fut_b = dcp.async_save(
        _big(100.0), storage_writer=UCVolumeWriter(tmp_path / "p0", options=options), checkpoint_id=b, no_dist=True
    )
    fut_a.result(timeout=120)
    fut_b.result(timeout=120)
    for loc, value in ((a, 1.0), (b, 100.0)):
        target = {k: torch.zeros(64, 1024) for k in _big(0.0)}
        dcp.load(target, storage_reader=UCVolumeReader(loc), no_dist=True)
        assert all(torch.equal(target[f"t{i}"], torch.full((64, 1024), value + i)) for i in range(8)), loc
        assert not list(loc.glob(".uc-save-*"))
    assert not (tmp_path / "p0").exists()  # the save went to its checkpoint_id, not the writer's path


@pytest.mark.parametrize("second", ["async_save", "save", "reset"])
def test_a_second_save_through_a_writer_in_flight_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    # DCP's contract: reset() starts a brand new checkpoint write. A second save while the first is
    # in flight (staged, or running in DCP's thread) is refused before it touches anything.
    _Rendezvous(monkeypatch, "upload_file")  # holds the first save's first upload until released
    writer = UCVolumeWriter(tmp_path / "A", options=WriterOptions(file_size_bytes=256 << 10))
    fut = dcp.async_save(_big(3.0), storage_writer=writer, no_dist=True)
    with pytest.raises(RuntimeError, match=ONE_WRITER_PER_SAVE) as info:
        if second == "async_save":
            dcp.async_save(_big(30.0), storage_writer=writer, checkpoint_id=tmp_path / "B", no_dist=True)
        elif second == "save":
            dcp.save(_big(30.0), storage_writer=writer, checkpoint_id=tmp_path / "B", no_dist=True)
        else:
            writer.reset(tmp_path / "B")
    assert "use a new UCVolumeWriter for each save" in str(info.value) and str(tmp_path / "A") in str(info.value)
    # The second save, through a writer of its own, runs beside the first (and releases it).
    dcp.save(_big(30.0), storage_writer=UCVolumeWriter(tmp_path / "B"), no_dist=True)
    fut.result(timeout=120)
    for loc, value in ((tmp_path / "A", 3.0), (tmp_path / "B", 30.0)):
        target = {k: torch.zeros(64, 1024) for k in _big(0.0)}
        dcp.load(target, storage_reader=UCVolumeReader(loc), no_dist=True)
        assert torch.equal(target["t0"], torch.full((64, 1024), value)), loc
    # Once the first save is over, the writer takes the next one.
    monkeypatch.undo()  # no more rendezvous
    dcp.save(_big(4.0), storage_writer=writer, checkpoint_id=tmp_path / "C", no_dist=True)
    assert (tmp_path / "C" / ".metadata").is_file()


def test_overlapping_saves_of_two_writers_fail_with_their_own_location(tmp_path: Path) -> None:
    # B's location is a file: B fails naming B; A, running at the same time, publishes.
    a, b = tmp_path / "A", tmp_path / "B"
    b.write_text("a file, not a directory")
    fut_a = dcp.async_save(_big(1.0), storage_writer=UCVolumeWriter(a), no_dist=True)
    fut_b = dcp.async_save(_big(2.0), storage_writer=UCVolumeWriter(tmp_path / "p0"), checkpoint_id=b, no_dist=True)
    with pytest.raises(BaseException) as info:
        fut_b.result(timeout=120)
    err = rank_error(info.value)
    assert str(b) in str(err) and str(a) not in str(err), err
    fut_a.result(timeout=120)
    assert (a / ".metadata").is_file()


def test_a_sync_save_right_after_an_async_save_is_refused_or_goes_through_its_own_writer(tmp_path: Path) -> None:
    # The caller's synchronous save reaches the writer before or after the async save's own thread
    # does: either way it is refused at once, and the async save goes where the writer pointed.
    for i in range(20):
        writer = UCVolumeWriter(tmp_path / f"P{i}")
        fut = dcp.async_save({"w": torch.ones(16), "step": 1}, storage_writer=writer, no_dist=True)
        second = {"w": torch.full((16,), 2.0), "step": 2}
        with pytest.raises(RuntimeError, match=ONE_WRITER_PER_SAVE):
            dcp.save(second, storage_writer=writer, checkpoint_id=tmp_path / f"Q{i}", no_dist=True)
        dcp.save(second, storage_writer=UCVolumeWriter(tmp_path / f"Q{i}"), no_dist=True)
        fut.result(timeout=60)
        for loc, value in ((tmp_path / f"P{i}", 1.0), (tmp_path / f"Q{i}", 2.0)):
            target = {"w": torch.zeros(16), "step": 0}
            dcp.load(target, storage_reader=UCVolumeReader(loc), no_dist=True)
            assert torch.equal(target["w"], torch.full((16,), value)) and target["step"] == value, (i, loc)


def test_an_async_save_dcp_fails_after_staging_keeps_its_writer_reserved(tmp_path: Path) -> None:
    # DCP's PROCESS mode without a process group raises after our stage(): that save's thread never
    # reaches the writer, and nothing tells the writer so. It stays reserved for that save (the
    # refusal says why); a new writer saves, and nothing of the dead save is published anywhere.
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    writer = UCVolumeWriter(tmp_path / "A")
    with pytest.raises(ValueError, match="process group"):
        dcp.async_save(
            {"w": torch.ones(16)}, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS
        )
    with pytest.raises(RuntimeError, match="if dcp.async_save raised after staging, that save never started"):
        writer.reset(tmp_path / "B")
    dcp.async_save({"w": torch.full((16,), 2.0)}, storage_writer=UCVolumeWriter(tmp_path / "B"), no_dist=True).result(
        timeout=60
    )
    assert (tmp_path / "B" / ".metadata").is_file() and not (tmp_path / "A").exists()


def test_a_writer_never_started_keeps_its_buffers_from_the_next_snapshot(tmp_path: Path) -> None:
    # A staging no save's thread took (DCP failed after it, or its thread is only slow) may still
    # be read: another writer of the same pool must not copy into those tensors.
    from uc_checkpoint import StagingBuffers

    pool = StagingBuffers()
    warm = UCVolumeWriter(tmp_path / "warm", staging_buffers=pool)
    dcp.async_save({"w": torch.zeros(1 << 16)}, storage_writer=warm, no_dist=True).result(timeout=60)
    writer = UCVolumeWriter(tmp_path / "A", staging_buffers=pool)
    # As async_save stages; no save's thread follows.
    held = writer.stage({"w": torch.ones(1 << 16)})["w"]
    assert pool.nbytes == 0  # lent to that snapshot
    with pytest.raises(RuntimeError, match=ONE_WRITER_PER_SAVE):
        dcp.async_save({"step": 2}, storage_writer=writer, no_dist=True)
    for step in (2, 3):
        fresh = UCVolumeWriter(tmp_path / f"B{step}", staging_buffers=pool)
        dcp.async_save({"w": torch.full((1 << 16,), float(step))}, storage_writer=fresh, no_dist=True).result(
            timeout=60
        )
    assert torch.equal(held, torch.ones(1 << 16))  # the untaken snapshot is intact
    assert pool.nbytes == (1 << 16) * 4  # the last save's own set is kept


@pytest.mark.parametrize("hand_over", [pickle.dumps, copy.deepcopy], ids=["pickle", "deepcopy"])
def test_a_staged_save_goes_with_the_pickle_another_thread_makes(
    tmp_path: Path, hand_over: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # DCP's PROCESS executor pickles the writer on its own thread for the checkpoint process: the
    # staged save goes there with it and is over here (its error, if any, is the other process's).
    writer = UCVolumeWriter(tmp_path / "A")
    writer.stage({"w": torch.ones(16)})
    copies: list[Any] = []
    thread = threading.Thread(target=lambda: copies.append(hand_over(writer)))
    thread.start()
    thread.join(timeout=60)
    with caplog.at_level(logging.ERROR):
        dcp.save(_step(2), storage_writer=writer, checkpoint_id=tmp_path / "B", no_dist=True)  # not refused
    assert _holds(tmp_path / "B") == 2.0 and not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("reader", ["checkpoint_id", "pickle"])
def test_the_staging_thread_reading_or_pickling_the_writer_takes_no_save(tmp_path: Path, reader: str) -> None:
    # The caller's own thread (DCP's logger reads checkpoint_id there; user code may copy the
    # writer) takes nothing: only DCP's save thread, or a pickle made elsewhere, does.
    writer = UCVolumeWriter(tmp_path / "A")
    writer.stage({"w": torch.ones(16)})
    if reader == "checkpoint_id":
        assert writer.checkpoint_id.endswith("A")
    else:
        clone = pickle.loads(pickle.dumps(writer))
        dcp.save(_step(5), storage_writer=clone, checkpoint_id=tmp_path / "C", no_dist=True)  # the copy is idle
        assert _holds(tmp_path / "C") == 5.0
    with pytest.raises(RuntimeError, match="staged for an async save not yet started"):
        writer.reset(tmp_path / "B")  # still staged


@pytest.fixture
def late_save_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's async save threads start their work 50 ms late, as when the OS schedules them late:
    whatever the caller does next reaches the writer first."""
    from torch.distributed.checkpoint import _async_thread_executor as executor

    real = executor.save_wrapper

    def late(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(executor, "save_wrapper", late)


def _holds(loc: Path) -> float | None:
    if not (loc / ".metadata").is_file():
        return None
    target = {"w": torch.zeros(16), "step": 0}
    dcp.load(target, storage_reader=UCVolumeReader(loc), no_dist=True)
    assert torch.equal(target["w"], torch.full((16,), float(target["step"]))), loc  # one save's bytes
    return float(target["step"])


def _step(n: int) -> dict[str, Any]:
    return {"w": torch.full((16,), float(n)), "step": n}


@pytest.mark.parametrize("how", ["checkpoint_id", "reset"])
def test_another_threads_writer_takes_nothing_from_an_async_save_not_started(
    tmp_path: Path, late_save_threads: None, how: str
) -> None:
    a, b = tmp_path / "A", tmp_path / "B"
    fut = dcp.async_save(_step(1), storage_writer=UCVolumeWriter(a), no_dist=True)

    def other() -> None:
        writer = UCVolumeWriter(tmp_path / "elsewhere")
        if how == "reset":
            writer.reset(b)
            dcp.save(_step(2), storage_writer=writer, no_dist=True)
        else:
            dcp.save(_step(2), storage_writer=writer, checkpoint_id=b, no_dist=True)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=60)
    fut.result(timeout=60)
    assert (_holds(a), _holds(b)) == (1.0, 2.0)


def test_a_failed_async_save_leaves_nothing_for_another_threads_save(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    a, b = tmp_path / "A", tmp_path / "B"
    dcp.save(_step(0), storage_writer=UCVolumeWriter(a), no_dist=True)  # a good checkpoint at A
    writer = UCVolumeWriter(a)
    with pytest.raises(ValueError, match="process group"):  # fails after our stage()
        dcp.async_save(_step(1), storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    thread = threading.Thread(target=lambda: dcp.save(_step(2), storage_writer=UCVolumeWriter(b), no_dist=True))
    thread.start()
    thread.join(timeout=60)
    assert (_holds(a), _holds(b)) == (0.0, 2.0)  # A's checkpoint kept, the new one at B


def test_pickling_a_writer_with_an_async_save_staged_leaves_that_save_alone(
    tmp_path: Path, late_save_threads: None
) -> None:
    a = tmp_path / "A"
    writer = UCVolumeWriter(a)
    fut = dcp.async_save(_step(1), storage_writer=writer, no_dist=True)
    clone = pickle.loads(pickle.dumps(writer))  # not DCP's PROCESS hand-over: nothing to take
    with pytest.raises(RuntimeError, match=ONE_WRITER_PER_SAVE):
        writer.reset(tmp_path / "B")
    fut.result(timeout=60)
    assert (_holds(a), _holds(tmp_path / "B")) == (1.0, None)
    dcp.save(_step(3), storage_writer=clone, checkpoint_id=tmp_path / "C", no_dist=True)
    assert _holds(tmp_path / "C") == 3.0


def test_another_threads_reset_while_a_save_is_begun_is_refused(tmp_path: Path) -> None:
    # reset(B) begins this thread's save; another thread's reset meanwhile is a second save.
    writer = UCVolumeWriter(tmp_path / "P")
    writer.reset(tmp_path / "B")
    errors: list[BaseException] = []

    def other() -> None:
        try:
            writer.reset(tmp_path / "C")
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=60)
    assert len(errors) == 1 and ONE_WRITER_PER_SAVE in str(errors[0])
    dcp.async_save(_step(1), storage_writer=writer, no_dist=True).result(timeout=60)
    dcp.save(_step(2), storage_writer=writer, checkpoint_id=tmp_path / "D", no_dist=True)
    assert (_holds(tmp_path / "B"), _holds(tmp_path / "C"), _holds(tmp_path / "D")) == (1.0, None, 2.0)


def test_a_save_dcp_stopped_between_our_hooks_frees_its_writer(tmp_path: Path) -> None:
    # An async save with a checkpoint_id that DCP fails after our reset(X): its thread ends without
    # our hooks knowing. The writer's next save is not refused for it; it goes where the last
    # reset pointed (X), as with DCP's FileSystemWriter, whose path sticks.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Failing(DefaultSavePlanner):
        def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
            raise RuntimeError("planner failed")

    b, x = tmp_path / "B", tmp_path / "X"
    writer = UCVolumeWriter(tmp_path / "unused")
    dcp.save(_step(1), storage_writer=writer, checkpoint_id=b, no_dist=True)
    failed = dcp.async_save(_step(2), storage_writer=writer, checkpoint_id=x, planner=Failing(), no_dist=True)
    with pytest.raises(BaseException, match="planner failed"):
        failed.result(timeout=60)
    dcp.async_save(_step(3), storage_writer=writer, no_dist=True).result(timeout=60)
    assert (_holds(b), _holds(x)) == (1.0, 3.0)


def test_an_async_save_goes_where_the_writer_pointed_when_it_was_called(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another thread's reset while this save's state is being copied is refused: it cannot be the
    # save's own thread (DCP makes that one after the copy), so this save does not move.
    from uc_checkpoint.dcp import writer as writer_module

    a, b = tmp_path / "A", tmp_path / "B"
    writer = UCVolumeWriter(a)
    real = writer_module.cpu_snapshot
    errors: list[BaseException] = []

    def reset_elsewhere() -> None:
        try:
            writer.reset(b)
        except RuntimeError as exc:
            errors.append(exc)

    def copy_while_another_thread_resets(state: Any, buffers: Any = None) -> Any:
        other = threading.Thread(target=reset_elsewhere)
        other.start()
        other.join(timeout=60)
        return real(state, buffers)

    monkeypatch.setattr(writer_module, "cpu_snapshot", copy_while_another_thread_resets)
    dcp.async_save(_step(1), storage_writer=writer, no_dist=True).result(timeout=60)
    assert (_holds(a), _holds(b)) == (1.0, None)
    assert len(errors) == 1 and ONE_WRITER_PER_SAVE in str(errors[0])


def test_two_readers_two_loads_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "A", tmp_path / "B"
    dcp.save(
        _big(1.0), storage_writer=UCVolumeWriter(a, options=WriterOptions(file_size_bytes=256 << 10)), no_dist=True
    )
    # Cut into other files than A, so that items sit at other offsets under other names.
    dcp.save(_big(50.0), storage_writer=UCVolumeWriter(b, options=WriterOptions(file_size_bytes=1 << 20)), no_dist=True)
    _Rendezvous(monkeypatch, "download_file")
    results: dict[str, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def load(loc: Path) -> None:
        target = {k: torch.zeros(64, 1024) for k in _big(0.0)}
        reader = UCVolumeReader(tmp_path / "nowhere", options=ReaderOptions(prefetch_files=True))
        try:
            dcp.load(target, storage_reader=reader, checkpoint_id=loc, no_dist=True)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)
        results[loc.name] = target

    threads = [threading.Thread(target=load, args=(loc,)) for loc in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert torch.equal(results["A"]["t3"], torch.full((64, 1024), 4.0))
    assert torch.equal(results["B"]["t3"], torch.full((64, 1024), 53.0))


def test_a_second_load_through_a_reader_in_flight_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = tmp_path / "A"
    dcp.save(_big(1.0), storage_writer=UCVolumeWriter(a), no_dist=True)
    reader = UCVolumeReader(a, options=ReaderOptions(prefetch_files=True))
    inside, release = threading.Event(), threading.Event()
    real = LocalVolume.download_file

    def held(volume: LocalVolume, *args: Any, **kwargs: Any) -> Any:
        inside.set()
        assert release.wait(60)
        return real(volume, *args, **kwargs)

    monkeypatch.setattr(LocalVolume, "download_file", held)
    target = {k: torch.zeros(64, 1024) for k in _big(0.0)}
    first = threading.Thread(target=lambda: dcp.load(target, storage_reader=reader, no_dist=True))
    first.start()
    assert inside.wait(60)
    with pytest.raises(BaseException, match="use a new UCVolumeReader for each load"):
        dcp.load({k: torch.zeros(64, 1024) for k in _big(0.0)}, storage_reader=reader, no_dist=True)
    release.set()
    first.join(timeout=120)
    assert torch.equal(target["t3"], torch.full((64, 1024), 4.0))
    dcp.load(target, storage_reader=reader, no_dist=True)  # over: the reader takes the next load


def test_a_writer_pickles_idle_at_its_location(tmp_path: Path) -> None:
    # DCP's PROCESS mode pickles the writer; a save of it in progress here must not travel.
    writer = UCVolumeWriter(tmp_path / "p0")
    dcp.save(_big(1.0), storage_writer=writer, checkpoint_id=tmp_path / "A", no_dist=True)
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.checkpoint_id == str(tmp_path / "A")  # checkpoint_id sticks, as with DCP's writers
    dcp.save(_big(2.0), storage_writer=clone, checkpoint_id=tmp_path / "C", no_dist=True)
    assert (tmp_path / "C" / ".metadata").is_file()


def test_two_async_saves_through_one_writer_second_refused(tmp_path: Path) -> None:
    # The second call's stage() runs on the caller's thread while the first is staged or running:
    # refused at once, before it copies anything; the first goes where the writer pointed.
    for i in range(25):
        writer = UCVolumeWriter(tmp_path / f"P{i}")
        first = dcp.async_save({"w": torch.ones(16)}, storage_writer=writer, no_dist=True)
        with pytest.raises(RuntimeError, match=ONE_WRITER_PER_SAVE):
            dcp.async_save(
                {"w": torch.full((16,), 2.0)}, storage_writer=writer, checkpoint_id=tmp_path / f"Q{i}", no_dist=True
            )
        second = dcp.async_save(
            {"w": torch.full((16,), 2.0)}, storage_writer=UCVolumeWriter(tmp_path / f"Q{i}"), no_dist=True
        )
        first.result(timeout=60)
        second.result(timeout=60)
        for loc, value in ((tmp_path / f"P{i}", 1.0), (tmp_path / f"Q{i}", 2.0)):
            target = {"w": torch.zeros(16)}
            dcp.load(target, storage_reader=UCVolumeReader(loc), no_dist=True)
            assert torch.equal(target["w"], torch.full((16,), value)), (i, loc)


@pytest.mark.slow
def test_destroying_the_process_group_under_a_save_never_publishes_one_ranks_share(tmp_path: Path) -> None:
    # Each rank saves its own key; the script destroys the group right after manager.save().
    # Before: DCP's background save then ran "without a process group" on each rank, and rank 0
    # published a checkpoint holding only its own share, listed as complete.
    root = tmp_path / "root"
    for attempt in range(3):
        proc = torchrun(SCRIPTS / "destroy_after_save.py", str(root / str(attempt)), timeout=240)
        out = proc.stdout + proc.stderr
        ckpt = root / str(attempt) / "step_00000003"
        if (ckpt / ".metadata").is_file():
            # Published despite the race: then it must be whole.
            target = {"r0": torch.zeros(2_000_000), "r1": torch.zeros(2_000_000)}
            dcp.load(target, storage_reader=UCVolumeReader(ckpt), no_dist=True)
            assert torch.equal(target["r1"], torch.arange(2_000_000, dtype=torch.float32) + 1), out[-3000:]
        else:
            assert "failed" in proc.stderr, out[-3000:]  # and said so, loudly
