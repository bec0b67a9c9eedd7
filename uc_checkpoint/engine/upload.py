"""One rank's uploads in one save: staged files go to the volume as soon as each is closed.

An :class:`UploadSession` owns what lives exactly as long as the rank's ``write_data``: the staging
directory, the upload pool and its :class:`~uc_checkpoint.engine.transfer.TransferGroup`, the size check of
every uploaded file, the timings, and the :class:`~uc_checkpoint.observability.TransferRecord`. Its way
out is registered on the group, as s3transfer registers "abort this upload" on its coordinator:
whichever way the save ends, the pool is shut down, the volume's clients are closed and the staging
directory is removed, once and in that order.
"""

from __future__ import annotations

import errno
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from uc_checkpoint.engine.staging_dir import STAGING_HINT, create_staging_dir
from uc_checkpoint.engine.transfer import TransferGroup, TransferPool
from uc_checkpoint.errors import StagingError, TransferError, UCCheckpointError
from uc_checkpoint.observability import TransferRecord
from uc_checkpoint.volumes import FileRecord, Volume

logger = logging.getLogger(__name__)


#: ``errno`` values of a write that found its disk (or the user's quota) full.
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class _StagingProbe(NamedTuple):
    """The staging disk as a failed save left it: whether the directory was gone, and its disk's
    free and total bytes (None when they could not be read)."""

    gone: bool
    free: int | None
    total: int | None


class UploadSession:
    """Uploads of one rank's data files in one save, used as a context manager::

        with UploadSession(volume, staging_path, workers=4, sync=True, rank=0) as uploads:
            write_files(uploads.staging, on_closed=uploads.submit)
            records, record = uploads.finish()

    Args:
        volume: where the files go; closed when the session ends (its transfer threads end
            there; its next use makes new ones).
        staging: this rank's staging directory for the save; created here, removed at the end.
        workers: files uploaded at once.
        sync: make each file durable on the volume before it counts as uploaded.
        rank: the rank, for thread names and the record.
        before_upload: called by each upload before it sends anything (the writer's wait for its
            claim on the location, :func:`uc_checkpoint.engine.publish.begin_save`): files can be
            staged while the location is claimed, and are uploaded only once it is. What it raises
            fails the session like a failed upload.

    Raises:
        StagingError: on construction, the staging directory cannot be created; on leaving the
            ``with`` block with an error, when the staging disk explains it (full, or the directory
            was deleted mid-save: DCP's serialiser reports those as an opaque ``RuntimeError`` or a
            bare ``FileNotFoundError``). Any other error leaves the block unchanged.
    """

    def __init__(
        self,
        volume: Volume,
        staging: Path,
        *,
        workers: int,
        sync: bool,
        rank: int,
        before_upload: Callable[[], object] | None = None,
    ) -> None:
        self.volume = volume
        self._before_upload = before_upload
        self.rank = rank
        self._sync = sync
        self._retries_before = volume.retries
        held = create_staging_dir(staging)
        self.staging = held.path
        self._started = time.perf_counter()
        self._spans: list[tuple[float, float]] = []  # (start, end) of each upload, perf_counter seconds
        self._probe: _StagingProbe | None = None
        self._pool = TransferPool(workers, name=f"uc-upload-r{rank}")
        self._group: TransferGroup[FileRecord] = TransferGroup(self._pool, f"upload to {volume.url}")
        # The probe must see the staging directory before the done callbacks remove it.
        self._group.add_failure_cleanup(self._probe_staging)
        self._group.add_done_callback(lambda: self._pool.shutdown(cancel_pending=True))
        self._group.add_done_callback(volume.close)
        self._group.add_done_callback(held.remove)

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` once when the session ends, after the staging directory is removed."""
        self._group.add_done_callback(fn)

    def submit(self, local: Path) -> None:
        """Upload a closed staging file under its path relative to the staging directory
        (``__0_<token>_0.distcp``, or ``<spread>/__0_...`` in a spread prefix; from any thread;
        blocks while the pool is full; ignored once an upload failed)."""
        self._group.submit(self._upload, local)

    def _upload(self, local: Path) -> FileRecord:
        if self._before_upload is not None:
            self._before_upload()
        t0 = time.perf_counter()
        staged_size = local.stat().st_size
        name = local.relative_to(self.staging).as_posix()
        record = self.volume.upload_file(local, name, sync=self._sync)  # verifies what landed
        self._spans.append((t0, time.perf_counter()))
        if record.size != staged_size:
            raise TransferError(
                f"{self.volume.url_of(name)} was uploaded with {record.size} bytes, {local} has {staged_size}"
            )
        local.unlink()  # free staging space as soon as the file is safe on the volume
        return record

    def finish(self) -> tuple[dict[str, FileRecord], TransferRecord]:
        """Every file is staged: wait for the uploads; return their records by file name and the
        rank's :class:`~uc_checkpoint.observability.TransferRecord` of the save.

        Raises:
            TransferError (or the volume's own error): the first failed upload.
        """
        staging_s = time.perf_counter() - self._started
        records = {r.name: r for r in self._group.results()}
        spans = self._spans
        record = TransferRecord(
            op="save",
            location=self.volume.url,
            rank=self.rank,
            bytes=sum(r.size for r in records.values()),
            files=len(records),
            total_s=time.perf_counter() - self._started,
            staging_s=staging_s,
            transfer_s=(max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0,
            retries=self.volume.retries - self._retries_before,
        )
        return records, record

    def __enter__(self) -> UploadSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A no-op after finish(); else it waits for the running uploads, then the clean-ups run.
        self._group.cancel()
        problem = None if exc is None else self._staging_problem(exc)
        if problem is not None:
            raise StagingError(
                f"{problem}; save to {self.volume.url} abandoned, nothing published; {STAGING_HINT}"
            ) from exc

    def _probe_staging(self) -> None:
        if not self.staging.is_dir():
            self._probe = _StagingProbe(True, None, None)
            return
        try:
            usage = shutil.disk_usage(self.staging)
        except OSError:
            self._probe = _StagingProbe(False, None, None)
            return
        self._probe = _StagingProbe(False, usage.free, usage.total)

    def _staging_problem(self, exc: BaseException) -> str | None:
        """A staging-disk cause behind a failed save, in words, or None: the directory vanished,
        the disk is (nearly) full, or the save failed with a bare ENOSPC/EDQUOT ``OSError``. The
        volume's own failures, disk full included, arrive wrapped in our errors and are left to
        their own messages; a bare one comes from writing the staging files."""
        probe = self._probe
        if probe is None:
            return None
        if probe.gone:
            return f"the staging directory {self.staging} disappeared during the save"
        free = "" if probe.free is None else f" ({probe.free} bytes free of {probe.total} after the failure)"
        if probe.free is not None and probe.free < (1 << 20):
            return f"the staging directory {self.staging} is full{free}: {exc!r}"
        if isinstance(exc, OSError) and not isinstance(exc, UCCheckpointError) and exc.errno in _DISK_FULL:
            return f"the staging directory {self.staging} is full{free}: {exc!r}"
        return None


__all__ = ["UploadSession"]
