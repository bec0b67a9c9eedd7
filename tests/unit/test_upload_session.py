"""A transfer group's way out (failure clean-ups, done callbacks) and one rank's upload session
(uc_checkpoint.engine.upload) on a local volume, without DCP."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from pathlib import Path

import pytest

from uc_checkpoint.engine.transfer import TransferGroup, TransferPool
from uc_checkpoint.engine.upload import UploadSession
from uc_checkpoint.errors import LocationNotEmptyError, StagingError, TransferError
from uc_checkpoint.volumes import FileRecord, LocalVolume

# ---- TransferGroup ---------------------------------------------------------------------------------


def test_done_callbacks_run_once_in_order_after_success() -> None:
    steps: list[str] = []
    with TransferPool(max_workers=2) as pool:
        group: TransferGroup[int] = TransferGroup(pool, "test")
        group.add_failure_cleanup(lambda: steps.append("failure cleanup"))
        group.add_done_callback(lambda: steps.append("done 1"))
        group.add_done_callback(lambda: steps.append("done 2"))
        for i in range(4):
            group.submit(lambda i=i: i * i)
        assert steps == []  # nothing ends while transfers may still come
        assert group.results() == [0, 1, 4, 9]
        assert steps == ["done 1", "done 2"]
        group.cancel()  # already ended: nothing runs again
        assert steps == ["done 1", "done 2"]


def test_a_failure_runs_the_cleanups_once_after_running_transfers_ended(caplog: pytest.LogCaptureFixture) -> None:
    steps: list[str] = []
    slow_done = threading.Event()

    def slow() -> int:
        time.sleep(0.2)
        slow_done.set()
        return 1

    def broken() -> int:
        raise TransferError("file 2 failed")

    def bad_cleanup() -> None:
        steps.append("bad cleanup")
        raise RuntimeError("cleanup broke")

    with TransferPool(max_workers=2) as pool:
        group: TransferGroup[int] = TransferGroup(pool, "test")
        group.add_done_callback(lambda: steps.append(f"done (slow finished: {slow_done.is_set()})"))
        group.add_failure_cleanup(bad_cleanup)
        group.add_failure_cleanup(lambda: steps.append("cleanup 2"))
        group.submit(slow)
        group.submit(broken)
        with caplog.at_level(logging.ERROR, logger="uc_checkpoint.engine.transfer"):
            with pytest.raises(TransferError, match="file 2 failed"):
                group.results()
        # Failure clean-ups first, then done callbacks; a raising one is logged and the rest still run.
        assert steps == ["bad cleanup", "cleanup 2", "done (slow finished: True)"]
        assert "cleanup broke" in caplog.text
        group.cancel()
        with pytest.raises(TransferError):
            group.results()
        assert len(steps) == 3


def test_cancel_runs_the_failure_cleanups_and_drops_later_submits() -> None:
    steps: list[str] = []
    with TransferPool(max_workers=1) as pool:
        group: TransferGroup[int] = TransferGroup(pool, "test")
        group.add_failure_cleanup(lambda: steps.append("cleanup"))
        group.add_done_callback(lambda: steps.append("done"))
        group.cancel()
        assert steps == ["cleanup", "done"]
        group.submit(lambda: 1)
        assert group.results() == []
        assert steps == ["cleanup", "done"]


# ---- UploadSession -------------------------------------------------------------------------------


class ClosingVolume(LocalVolume):
    """Counts close() calls."""

    closed = 0

    def close(self) -> None:
        self.closed += 1
        super().close()


def _stage(staging: Path, name: str, size: int) -> Path:
    path = staging / name
    path.write_bytes(b"x" * size)
    return path


def test_a_session_uploads_records_and_cleans_up(tmp_path: Path) -> None:
    volume = ClosingVolume(tmp_path / "ckpt")
    volume.prepare_for_write()
    ended: list[bool] = []
    staging_path = tmp_path / "staging" / "save-x" / "rank-0"
    with UploadSession(volume, staging_path, workers=2, sync=False, rank=3) as uploads:
        assert uploads.staging == staging_path and staging_path.is_dir()
        uploads.add_done_callback(lambda: ended.append(staging_path.exists()))
        for i, size in enumerate((10, 20, 30)):
            uploads.submit(_stage(uploads.staging, f"__3_t_{i}.distcp", size))
        deadline = time.monotonic() + 10
        while any(uploads.staging.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(uploads.staging.iterdir())  # each staged file goes once it is on the volume
        records, record = uploads.finish()
    assert {n: r.size for n, r in records.items()} == {"__3_t_0.distcp": 10, "__3_t_1.distcp": 20, "__3_t_2.distcp": 30}
    assert volume.list_files() == {"__3_t_0.distcp": 10, "__3_t_1.distcp": 20, "__3_t_2.distcp": 30}
    assert (record.op, record.rank, record.files, record.bytes) == ("save", 3, 3, 60)
    assert record.location == volume.url and record.total_s >= record.staging_s >= 0 and record.transfer_s > 0
    assert not staging_path.exists() and ended == [False]  # removed, then the caller's callback
    assert volume.closed == 1


def test_a_failed_upload_ends_the_session_and_keeps_its_error(tmp_path: Path) -> None:
    class FailingVolume(ClosingVolume):
        def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
            if name.endswith("_1.distcp"):
                raise TransferError(f"{self.url_of(name)}: store on fire")
            return super().upload_file(local_path, name, sync=sync)

    volume = FailingVolume(tmp_path / "ckpt")
    volume.prepare_for_write()
    staging_path = tmp_path / "staging" / "rank-0"
    with pytest.raises(TransferError, match="store on fire"):
        with UploadSession(volume, staging_path, workers=1, sync=False, rank=0) as uploads:
            for i in range(3):
                uploads.submit(_stage(uploads.staging, f"__0_t_{i}.distcp", 5))
            uploads.finish()
    assert not staging_path.exists() and volume.closed == 1


def test_uploads_wait_for_before_upload_and_fail_with_its_error(tmp_path: Path) -> None:
    # The writer's claim on its location gates every upload, not the staging of files.
    gate, calls = threading.Event(), []

    def claimed() -> None:
        calls.append(threading.current_thread().name)
        assert gate.wait(10)

    volume = LocalVolume(tmp_path / "ckpt")
    volume.prepare_for_write()
    with UploadSession(volume, tmp_path / "staging" / "a", workers=2, sync=False, rank=0, before_upload=claimed) as up:
        for i in range(3):
            up.submit(_stage(up.staging, f"__0_t_{i}.distcp", 5))
        time.sleep(0.2)
        assert volume.list_files() == {} and len(list(up.staging.iterdir())) == 3  # staged, none sent
        gate.set()
        records, _ = up.finish()
    assert sorted(records) == [f"__0_t_{i}.distcp" for i in range(3)] and len(calls) == 3

    def refused() -> None:
        raise LocationNotEmptyError("checkpoint location holds notes.txt")

    other = LocalVolume(tmp_path / "other")
    other.prepare_for_write()
    with pytest.raises(LocationNotEmptyError, match="notes.txt"):
        with UploadSession(
            other, tmp_path / "staging" / "b", workers=1, sync=False, rank=0, before_upload=refused
        ) as up:
            up.submit(_stage(up.staging, "__0_t_0.distcp", 5))
            up.finish()
    assert other.list_files() == {} and not (tmp_path / "staging" / "b").exists()


def test_a_wrong_size_on_the_volume_fails_the_upload(tmp_path: Path) -> None:
    class ShortVolume(LocalVolume):
        def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
            record = super().upload_file(local_path, name, sync=sync)
            return dataclasses.replace(record, size=record.size - 1)

    volume = ShortVolume(tmp_path / "ckpt")
    volume.prepare_for_write()
    with pytest.raises(TransferError, match=r"__0_t_0\.distcp was uploaded with 4 bytes, .* has 5"):
        with UploadSession(volume, tmp_path / "staging" / "rank-0", workers=1, sync=False, rank=0) as uploads:
            uploads.submit(_stage(uploads.staging, "__0_t_0.distcp", 5))
            uploads.finish()


def test_a_vanished_staging_directory_is_named_as_the_cause(tmp_path: Path) -> None:
    volume = LocalVolume(tmp_path / "ckpt")
    volume.prepare_for_write()
    staging_path = tmp_path / "staging" / "rank-0"
    with pytest.raises(
        StagingError, match="disappeared during the save; save to .* abandoned, nothing published"
    ) as err:
        with UploadSession(volume, staging_path, workers=1, sync=False, rank=0) as uploads:
            shutil.rmtree(uploads.staging)
            raise FileNotFoundError("the serialiser's file is gone")
    assert isinstance(err.value.__cause__, FileNotFoundError)


def test_other_errors_leave_the_session_unchanged(tmp_path: Path) -> None:
    volume = ClosingVolume(tmp_path / "ckpt")
    staging_path = tmp_path / "staging" / "rank-0"
    with pytest.raises(RuntimeError, match="serialiser broke"):
        with UploadSession(volume, staging_path, workers=1, sync=False, rank=0):
            raise RuntimeError("serialiser broke")
    assert not staging_path.exists() and volume.closed == 1


def test_a_staging_directory_that_cannot_be_made_fails_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StagingError, match="cannot create staging directory"):
        UploadSession(LocalVolume(tmp_path / "ckpt"), blocker / "rank-0", workers=1, sync=False, rank=0)
