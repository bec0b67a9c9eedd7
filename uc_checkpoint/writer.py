"""``UCVolumeWriter``: a DCP storage writer that stages files locally and uploads them in parallel.

Where a byte goes, from ``dcp.async_save`` to the volume:

1. ``stage()``: the state dict is copied to CPU memory, every tensor once
   (:func:`~uc_checkpoint.snapshot.cpu_snapshot`); this is the only time training is blocked.
2. ``write_data`` (every rank, in DCP's background thread or process): the rank's items are
   serialised in DCP's file format (one ``torch.save`` archive per tensor, small ones through
   :class:`~uc_checkpoint.item_codec.ItemCodec`) into a few data files in a per-rank staging
   directory. As each file is closed,
   it is handed to a :class:`~uc_checkpoint.transfer.TransferPool`, so uploads overlap serialising the
   next file. ``write_data`` returns once every file of the rank is on the volume with its size
   checked.
3. ``finish`` (coordinator, called by DCP only after every rank's ``write_data`` succeeded): checks
   that every data file of every rank is on the volume with the right size, then publishes
   ``.metadata`` (with the file manifest inside) in one atomic write. Nothing else is ever written
   after it, except deleting data files of older saves at the same location that the new
   ``.metadata`` no longer references.

If any rank fails, DCP never calls ``finish``: no ``.metadata`` is published, and a previous
checkpoint at the location stays loadable (new data files carry a per-save token in their names).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import queue
import shutil
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import exit_guard, layout, metadata_io
from .dcp_compat import (
    CURRENT_DCP_VERSION,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
    cpu_loader,
)
from .errors import (
    CheckpointExistsError,
    ConcurrentSaveError,
    LocationNotEmptyError,
    StagingError,
    TransferError,
    UCCheckpointError,
)
from .item_codec import ItemCodec
from .records import TransferRecord
from .sessions import Session, SessionOwner
from .snapshot import UnsupportedSnapshot, cpu_snapshot
from .staging import create_staging_dir, remove_staging_dir, staging_dir_for
from .transfer import TransferGroup, TransferPool
from .volumes import FileRecord, Volume

logger = logging.getLogger(__name__)

exit_guard.install()  # a save in flight when the script ends is finished first

#: The automatic data-file size (``file_size_bytes=None``): a rank's share of the checkpoint is cut
#: into about this many files, so the first upload starts early and the last one is short, but the
#: files stay between the two bounds (bytes) to keep request and object counts sane. With 64 MiB
#: files a 242 MiB checkpoint published 1.26x later on S3 than with this rule (docs/benchmarks.md).
AUTO_FILES_PER_RANK = 16
MIN_AUTO_FILE_SIZE = 16 << 20
MAX_AUTO_FILE_SIZE = 256 << 20


def auto_file_size(rank_bytes: int) -> int:
    """Target size in bytes of one data file for a rank saving ``rank_bytes`` bytes: about
    ``rank_bytes / AUTO_FILES_PER_RANK``, clamped to [16 MiB, 256 MiB]."""
    return min(MAX_AUTO_FILE_SIZE, max(MIN_AUTO_FILE_SIZE, -(-rank_bytes // AUTO_FILES_PER_RANK)))


# Incomplete multipart uploads younger than this (seconds) may belong to a save still running.
_LIVE_UPLOAD_S = 3600.0


@dataclass
class _UploadedStorageInfo(_StorageInfo):
    """``_StorageInfo`` plus what the upload recorded for the whole file; it travels from each
    rank's ``write_data`` to the coordinator's ``finish`` and is turned back into a plain
    ``_StorageInfo`` before ``.metadata`` is written, so stock readers can load the checkpoint."""

    record: FileRecord | None = None

    def plain(self) -> _StorageInfo:
        return _StorageInfo(self.relative_path, self.offset, self.length, self.transform_descriptors)


def _new_token() -> str:
    return uuid.uuid4().hex[:8]


@dataclass
class _SaveSession(Session):
    """One save on one rank (see :mod:`uc_checkpoint.sessions`).

    Attributes:
        token: random part of this save's data-file and marker names, so a save never reuses the
            names of a published checkpoint's files, even when one writer object saves twice.
        save_id: recorded in the manifest and ``StorageMeta``.
        published_digest: sha256 of the ``.metadata`` published at the location when the save
            started (``""`` for none; None until checked): a change by ``finish`` means another save
            published meanwhile.
        staging: this rank's staging directory while ``write_data`` runs.
        ticket: keeps the interpreter's exit waiting while the save is in flight.
    """

    token: str = field(default_factory=_new_token)
    save_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    is_coordinator: bool = False
    published_digest: str | None = None
    staging: Path | None = None
    ticket: exit_guard.SaveTicket | None = None


class _StagingFileSystem(FileSystem):
    """DCP's local filesystem that reports every data file it finishes writing."""

    def __init__(self) -> None:
        super().__init__()
        self.on_file_written: Callable[[Path], None] | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            yield stream
        callback = self.on_file_written
        if callback is not None and "w" in mode:
            callback(Path(path))


class UCVolumeWriter(SessionOwner, FileSystemWriter):
    """DCP storage writer for a volume: a local or FUSE path, ``s3://bucket/prefix`` or an fsspec URL.

    Use exactly like DCP's writers::

        dcp.async_save(state_dict, storage_writer=UCVolumeWriter("/mnt/vol/ckpt/step_100"))
        dcp.save(state_dict, storage_writer=UCVolumeWriter(path))

    Args:
        path: the checkpoint's location on the volume (a directory path or URL, or a
            :class:`~uc_checkpoint.volumes.Volume`). ``checkpoint_id=`` passed to ``dcp.save``
            replaces it.
        staging_dir: local directory for serialised files before upload. Default:
            ``$UC_CHECKPOINT_STAGING_DIR`` or the system temp dir. Needs free space for the rank's
            share of the checkpoint at most (files are deleted as soon as they are uploaded).
        upload_workers: files uploaded at once per rank.
        thread_count: DCP serialisation threads per rank.
        file_size_bytes: target size of one data file in bytes; smaller files start uploading
            sooner but cost more requests. None (default): :func:`auto_file_size` of the rank's share
            (about 16 files, 16-256 MiB each).
        overwrite: allow replacing a checkpoint already published at ``path``. The old checkpoint
            stays loadable until the new ``.metadata`` replaces it.
        create_parents: create missing parent directories of a local ``path``.
        sync_files: fsync data files and ``.metadata`` on the volume before publishing.
        volume_options: options for the volume of a path or URL, e.g. ``{"endpoint_url": ...,
            "checksums": False}`` for S3 (see :func:`uc_checkpoint.volumes.open_volume`).

    Raises (inside DCP's ``CheckpointException``):
        VolumeError: the location is a file, not writable, or its parent is missing (local and
            fsspec volumes); the bucket does not exist or cannot be reached (S3, where a location
            is a key prefix and an object of the same name does not block it).
        LocationNotEmptyError: the location holds files that are not part of a checkpoint.
        CheckpointExistsError: ``overwrite=False`` and a checkpoint is published there.
        ConcurrentSaveError: another save at the same location started after this one, or published
            while this one ran (this one publishes nothing; see :mod:`uc_checkpoint.layout`).
        StagingError: the staging directory cannot be created, is full, or was deleted mid-save.
        TransferError: an upload failed or landed with the wrong size or checksum, or the
            ``.metadata`` read back after publishing is not this save's (a mount that reports a
            rename or write as done and loses it): nothing is deleted then.

    One writer object may serve several saves at once (overlapping ``dcp.async_save`` calls, each
    with its own ``checkpoint_id``): each save's state is its own (:mod:`uc_checkpoint.sessions`). A
    save still in flight when the interpreter exits is finished first (:mod:`uc_checkpoint.exit_guard`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Volume,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        upload_workers: int = 4,
        thread_count: int = 1,
        file_size_bytes: int | None = None,
        overwrite: bool = True,
        create_parents: bool = True,
        sync_files: bool = True,
        volume_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike, Volume)):
            raise TypeError(f"path must be a path, URL or Volume, got {type(path).__name__}")
        for arg, value in (
            ("upload_workers", upload_workers),
            ("thread_count", thread_count),
            ("file_size_bytes", 1 if file_size_bytes is None else file_size_bytes),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
        if upload_workers < 1:
            raise ValueError(f"upload_workers must be >= 1, got {upload_workers}")
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if file_size_bytes is not None and file_size_bytes < 1:
            raise ValueError(f"file_size_bytes must be >= 1, got {file_size_bytes}")
        self._init_sessions(path, volume_options)
        # Async saves staged but not yet set up: their exit ticket, where the caller's writer pointed
        # then (another save's reset may move it before this one's thread starts), and the world
        # size it was staged in (None without a process group).
        self._pending: deque[tuple[exit_guard.SaveTicket, str | Volume, int | None]] = deque()
        # Staging files are temporary: fsync there is wasted; durability is enforced on the volume.
        super().__init__(
            path=".", single_file_per_rank=True, sync_files=False, thread_count=thread_count, overwrite=overwrite
        )
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        self.upload_workers = upload_workers
        self.file_size_bytes = file_size_bytes
        self.create_parents = create_parents
        self.sync_volume = sync_files
        #: This rank's :class:`~uc_checkpoint.records.TransferRecord` of the last save (None before
        #: one succeeded; in DCP's PROCESS mode it stays in the background process).
        self.last_record: TransferRecord | None = None

    session_type = _SaveSession

    @property
    def _save(self) -> _SaveSession:
        session = self._session
        assert isinstance(session, _SaveSession)
        return session

    # FileSystemWriter keeps these on the object; here they belong to the save (sessions.py).
    @property
    def save_id(self) -> str:
        return self._save.save_id

    @save_id.setter
    def save_id(self, value: str) -> None:
        self._save.save_id = value

    @property
    def is_coordinator(self) -> bool:
        return self._save.is_coordinator

    @property  # type: ignore[override]
    def path(self) -> Path | None:
        """This save's staging directory, where DCP's serialiser writes (None outside write_data)."""
        return self._save.staging

    @path.setter
    def path(self, value: Any) -> None:
        pass  # FileSystemWriter's own path is never used: every byte goes through staging

    def __getstate__(self) -> dict[str, Any]:
        # DCP's PROCESS mode pickles the writer for its background process: a save staged here
        # continues there, where the exit guard has nothing to wait for.
        state = super().__getstate__()
        if self._pending:
            self._pending.popleft()[0].end()
        state["_pending"] = deque()
        return state

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reset_location(checkpoint_id)

    # ---- staging (the only part of async_save that blocks training) --------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` to CPU memory for ``dcp.async_save``: each tensor once (DCP's own
        stager copies a DTensor's shard twice); falls back to DCP's stager for a ``ShardedTensor`` or
        another tensor subclass (other than DTensor and Parameter)."""
        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the snapshot is on CPU already
        try:
            staged = cpu_snapshot(state_dict)
        except UnsupportedSnapshot as exc:
            logger.debug("staging with DCP's stager: %s", exc)
            staged = super().stage(state_dict)
        # The save's thread does not exist yet: an exit right after async_save must still wait.
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        self._pending.append((exit_guard.open_ticket(str(self._location), background=True), self._location, world))
        return staged

    # ---- planning -----------------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        try:
            ticket, location, world = self._pending.popleft()
        except IndexError:  # a synchronous save (or PROCESS mode's background process)
            ticket, location, world = exit_guard.open_ticket(str(self._location)), None, None
        save = self._begin_session(location)
        assert isinstance(save, _SaveSession)
        save.ticket = ticket
        ticket.bind(save.volume.url)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        save.is_coordinator = is_coordinator
        if world is not None and world > 1 and not (dist.is_available() and dist.is_initialized()):
            # DCP decides "no process group, save alone" when the background save starts: a group
            # destroyed meanwhile would have each rank publish its own share as the whole checkpoint.
            error = StagingError(
                f"save to {save.volume.url} abandoned: it was started by {world} ranks, but the process group "
                "was destroyed before it ran (call CheckpointManager.wait() or the save's future .result() "
                "before dist.destroy_process_group()); nothing is published"
            )
            ticket.end(error)
            raise error

    def _end_save(self, error: BaseException | None = None) -> None:
        """This rank's part of the save is over: the interpreter's exit need not wait for it."""
        ticket = self._save.ticket
        if ticket is not None:
            ticket.end(error)

    def _staging_path(self) -> Path:
        return staging_dir_for(self.staging_dir, "save", self.checkpoint_id, self._save.token, self._rank())

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            # Fail in the planning step, before anything is written anywhere: probe that staging can
            # be created (write_data creates it again), so a failed plan leaves no directory behind.
            staging = self._staging_path()
            create_staging_dir(staging)
            remove_staging_dir(staging)
            if self.is_coordinator or not self.use_collectives:
                self._check_location()
        except BaseException as exc:
            self._end_save(exc)
            raise
        if not self.use_collectives:
            plan = dataclasses.replace(
                plan, storage_data=_StoragePrefix(layout.data_file_prefix(self._rank(), self._save.token))
            )
        return plan

    def _check_location(self) -> None:
        volume = self.volume
        volume.prepare_for_write(create_parents=self.create_parents)
        files = volume.list_files()
        foreign = sorted(name for name in files if not layout.is_checkpoint_file(name))
        if foreign:
            shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise LocationNotEmptyError(
                f"checkpoint location {volume.url} holds files that are not part of a checkpoint: {shown}"
            )
        meta = layout.metadata_name(None if self.use_collectives else self._rank())
        self._save.published_digest = ""
        if meta in files:
            if not self.overwrite:
                raise CheckpointExistsError(f"{volume.describe(meta)} exists and overwrite=False")
            logger.info("replacing the checkpoint published at %s", volume.url)
            self._save.published_digest = _digest(volume.read_bytes(meta))
        # Uploads a killed save left behind (S3 multipart uploads) cost storage and are never
        # completed; no rank of this save has started uploading yet. While another save's marker is
        # there, its uploads may be live: only old ones go (gc takes the rest).
        other_saves = any(layout.parse_save_marker(name) for name in files)
        aborted = volume.abort_incomplete_uploads(older_than_s=_LIVE_UPLOAD_S if other_saves else None)
        if aborted:
            logger.info("aborted %d incomplete uploads left at %s", aborted, volume.url)
        marker = {"save_id": self.save_id, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        # The name carries this save's random token, so a plain PUT cannot clobber another marker
        # (a conditional one would fail on S3-compatible stores without If-None-Match support).
        volume.publish_bytes(self._marker_name(), json.dumps(marker).encode(), overwrite=True)

    def _marker_name(self) -> str:
        return layout.save_marker_name(self._save.token, None if self.use_collectives else self._rank())

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            plan
            if plan.storage_data is not None
            else dataclasses.replace(plan, storage_data=_StoragePrefix(layout.data_file_prefix(i, self._save.token)))
            for i, plan in enumerate(plans)
        ]

    # ---- writing ------------------------------------------------------------------------------
    def _file_queue(self, plan: SavePlan, staging: Path) -> queue.Queue[tuple[Path, str, list[Any]]]:
        prefix = plan.storage_data.prefix
        total = sum(_chunk_bytes(item) for item in plan.items if item.type != WriteItemType.BYTE_IO)
        size = self.file_size_bytes if self.file_size_bytes is not None else auto_file_size(total)
        n_files = max(self.thread_count, math.ceil(total / size), 1)
        file_queue: queue.Queue[tuple[Path, str, list[Any]]] = queue.Queue()
        buckets = [b for b in _split_by_size_and_type(n_files, list(plan.items)) if b]
        for n, bucket in enumerate(buckets):
            name = f"{prefix}{n}{DEFAULT_SUFFIX}"
            file_queue.put((staging / name, name, bucket))
        return file_queue

    def _serialise(
        self, planner: SavePlanner, file_queue: queue.Queue[tuple[Path, str, list[Any]]], fs: _StagingFileSystem
    ) -> list[WriteResult]:
        """Write every queued data file (``thread_count`` threads); each file is handed to the upload
        pool by ``fs`` as soon as it is closed. The format is DCP's (what
        ``FileSystemWriter`` writes with ``SerializationFormat.TORCH_SAVE``), so stock readers load it."""
        codec = ItemCodec()
        results: list[WriteResult] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def work() -> None:
            try:
                while not errors:
                    try:
                        path, storage_key, items = file_queue.get_nowait()
                    except queue.Empty:
                        return
                    written = self._serialise_file(path, storage_key, items, planner, codec, fs)
                    with lock:
                        results.extend(written)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(exc)

        threads = [
            threading.Thread(target=work, name=f"uc-serialise-{i}", daemon=True) for i in range(1, self.thread_count)
        ]
        for t in threads:
            t.start()
        work()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        logger.debug("%d of %d tensor items serialised through templates", codec.fast_encoded, codec.encoded)
        return results

    def _serialise_file(
        self,
        path: Path,
        storage_key: str,
        items: list[Any],
        planner: SavePlanner,
        codec: ItemCodec,
        fs: _StagingFileSystem,
    ) -> list[WriteResult]:
        # As DCP's writer: accelerator tensors of a synchronous save are copied to the CPU a little
        # ahead of serialisation (async saves arrive here already on the CPU).
        loader = cpu_loader(planner.resolve_data, self.thread_count, self.per_thread_copy_ahead)
        for item in items:
            if item.type != WriteItemType.BYTE_IO:
                loader.add(_chunk_bytes(item), item)
        loader.start_loading()
        out: list[WriteResult] = []
        with fs.create_stream(path, "wb") as stream:
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    offset = stream.tell()
                    stream.write(cast(io.BytesIO, planner.resolve_data(item)).getbuffer())
                    out.append(_write_result(item, storage_key, offset, stream.tell() - offset))
            for tensor, item in loader.values():
                offset = stream.tell()
                codec.write(tensor, stream)
                out.append(_write_result(item, storage_key, offset, stream.tell() - offset))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            fut = self._write_rank_data(plan, planner)
        except BaseException as exc:
            self._end_save(exc)
            raise
        if self.use_collectives and not self.is_coordinator:
            self._end_save()  # what is left on this rank is DCP's collectives, which need no pools
        return fut

    def _write_rank_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        volume = self.volume
        staging = create_staging_dir(self._staging_path())
        self._save.staging = staging
        started = time.perf_counter()
        sync = self.sync_volume
        retries_before = volume.retries
        spans: list[tuple[float, float]] = []

        def upload(local: Path) -> FileRecord:
            t0 = time.perf_counter()
            staged_size = local.stat().st_size
            record = volume.upload_file(local, local.name, sync=sync)  # verifies what landed
            spans.append((t0, time.perf_counter()))
            if record.size != staged_size:
                raise TransferError(
                    f"{volume.describe(local.name)} was uploaded with {record.size} bytes, {local} has {staged_size}"
                )
            local.unlink()  # free staging space as soon as the file is safe on the volume
            return record

        pool = TransferPool(self.upload_workers, name=f"uc-upload-r{self._rank()}")
        group: TransferGroup[FileRecord] = TransferGroup(pool, f"upload to {volume.url}")
        # One per save: overlapping saves of one writer object each upload their own files.
        fs = _StagingFileSystem()
        fs.on_file_written = lambda path: group.submit(upload, path)
        try:
            try:
                results = self._serialise(planner, self._file_queue(plan, staging), fs)
            finally:
                fs.on_file_written = None
                staging_s = time.perf_counter() - started
            records = {r.name: r for r in group.results()}
        except BaseException as exc:
            group.cancel()
            problem = _staging_problem(staging, exc)
            if problem is not None:
                raise StagingError(f"{problem}; save to {volume.url} abandoned, nothing published") from exc
            raise
        finally:
            pool.shutdown(cancel_pending=True)
            volume.close()  # its transfer threads end here; the next use makes new ones
            remove_staging_dir(staging)
            self._save.staging = None

        out: list[WriteResult] = []
        for wr in results:
            info: _StorageInfo = wr.storage_data
            record = records.get(info.relative_path)
            if record is None:  # a bug, not an I/O fault: never publish over it
                raise TransferError(f"{volume.describe(info.relative_path)} was written but never uploaded")
            out.append(
                dataclasses.replace(
                    wr,
                    storage_data=_UploadedStorageInfo(
                        info.relative_path,
                        info.offset,
                        info.length,
                        info.transform_descriptors,
                        record=record,
                    ),
                )
            )
        self.last_record = TransferRecord(
            op="save",
            location=volume.url,
            rank=self._rank(),
            bytes=sum(r.size for r in records.values()),
            files=len(records),
            total_s=time.perf_counter() - started,
            staging_s=staging_s,
            transfer_s=(max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0,
            retries=volume.retries - retries_before,
        )
        logger.info("%s", self.last_record.describe())
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(out)
        return fut

    # ---- publishing ---------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        except BaseException as exc:
            self._end_save(exc)
            raise
        self._end_save()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        volume = self.volume
        records: dict[str, FileRecord] = {}
        storage_md: dict[Any, _StorageInfo] = {}
        for rank_results in results:
            for wr in rank_results:
                info = wr.storage_data
                if isinstance(info, _UploadedStorageInfo):
                    if info.record is not None:
                        records[info.relative_path] = info.record
                    info = info.plain()
                storage_md[wr.index] = info
        # Every data file of every rank must be on the volume, whole, before .metadata exists.
        listing = volume.list_files()
        for name, record in records.items():
            if listing.get(name) != record.size:
                raise TransferError(
                    f"not publishing {volume.url}: {volume.describe(name)} has "
                    f"{listing.get(name)} bytes on the volume, expected {record.size}"
                )
        for name in {info.relative_path for info in storage_md.values()} - records.keys():
            raise TransferError(f"not publishing {volume.url}: no upload record for {name}")

        mine = self._marker_name()
        try:
            self._check_no_newer_save(volume, listing, mine)
            self._publish(volume, metadata, storage_md, records, listing)
        finally:
            try:
                volume.delete(mine)
            except Exception as exc:  # noqa: BLE001 - a leftover marker is harmless; gc removes it
                logger.warning("could not delete the save marker %s: %s", volume.describe(mine), exc)

    def _check_no_newer_save(self, volume: Volume, listing: dict[str, int], mine: str) -> None:
        """Raise ConcurrentSaveError when another save started at this location after this one.

        Markers are ordered by the store's modification time (one clock for every job), ties by
        name, so two saves agree on which is newer and exactly one of them publishes. A killed save's
        marker is older than this save's, so it never blocks a resumed job re-saving a step."""
        slot = (layout.parse_save_marker(mine) or (None, ""))[0]
        others = sorted(n for n in listing if n != mine and (layout.parse_save_marker(n) or (-1, ""))[0] == slot)
        if not others:
            return
        mtimes = volume.list_mtimes()
        if mine not in mtimes:
            newer = others  # cannot order without our own marker: assume the worst
        else:
            newer = [n for n in others if n in mtimes and (mtimes[n], n) > (mtimes[mine], mine)]
        if newer:
            raise ConcurrentSaveError(
                f"not publishing {volume.url}: another save started at this location while this one ran "
                f"({_describe_marker(volume, newer[-1])}); the newer save publishes, this one is abandoned"
            )

    def _publish(
        self,
        volume: Volume,
        metadata: Metadata,
        storage_md: dict[Any, _StorageInfo],
        records: dict[str, FileRecord],
        listing: dict[str, int],
    ) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        saved_by = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        setattr(metadata, layout.MANIFEST_ATTR, layout.build_manifest(self.save_id, records.values(), saved_by))
        rank = None if self.use_collectives else self._rank()
        meta_name = layout.metadata_name(rank)
        current = volume.read_bytes(meta_name) if meta_name in listing else None
        if self._save.published_digest is not None and _digest(current) != self._save.published_digest:
            raise ConcurrentSaveError(
                f"not publishing {volume.url}: another save published {volume.describe(meta_name)} while "
                f"this one ran ({_describe_publisher(current, volume.describe(meta_name))}); that checkpoint "
                "is kept and this save is abandoned"
            )
        superseded = self._files_of_published(volume, meta_name, current)
        blob = metadata_io.dump_metadata(metadata)
        volume.publish_bytes(meta_name, blob, overwrite=self.overwrite)
        # Confirm by content before anything is deleted: some mounts report a rename or a write as
        # done and lose it, and the replaced .metadata may have exactly the new one's size. Deleting
        # the old checkpoint's files then would lose both checkpoints.
        landed = volume.read_bytes(meta_name)
        if landed != blob:
            found = (
                "nothing"
                if landed is None
                else f"{len(landed)} bytes of other content ({_describe_publisher(landed, volume.describe(meta_name))})"
            )
            raise TransferError(
                f"not published: {volume.describe(meta_name)} was written ({len(blob)} bytes) but reading it back "
                f"gives {found}; the volume lost the write. Nothing was deleted: the checkpoint that was "
                "there (if any) and this save's data files are kept"
            )
        logger.info("published %s (%d data files)", volume.describe(meta_name), len(records))
        # A rollback's abandonment marker annotated the checkpoint just replaced (uc_checkpoint.lineage).
        stale = {layout.ABANDONED_NAME} if rank is None and layout.ABANDONED_NAME in listing else set()
        self._remove_superseded_files(volume, (superseded - set(records)) | stale)

    def _files_of_published(self, volume: Volume, meta_name: str, raw: bytes | None) -> set[str]:
        """Data files the ``.metadata`` about to be replaced (``raw``) references (empty when it
        cannot be read: then nothing is deleted and garbage collection deals with the files later)."""
        if raw is None:
            return set()
        try:
            old = metadata_io.load_metadata(raw, volume.describe(meta_name))
        except UCCheckpointError as exc:
            logger.warning("not deleting the data files of the replaced checkpoint: %s", exc)
            return set()
        return layout.data_file_names(old)

    def _remove_superseded_files(self, volume: Volume, names: set[str]) -> None:
        """Delete the data files of the checkpoint this save replaced, and only those.

        Files no published ``.metadata`` references are not touched here: they may belong to another
        job's save in progress at this location (deleting them could leave that save publishing over
        missing files), or to a save that crashed; ``uc-checkpoint gc`` removes them once they are
        older than its grace period. Best effort: a failure is logged, never raised."""
        for name in sorted(names):
            try:
                volume.delete(name)
            except Exception as exc:  # noqa: BLE001 - cleanup must not fail a published save
                logger.warning("could not delete superseded file %s: %s", volume.describe(name), exc)


def _chunk_bytes(item: Any) -> int:
    """Bytes of the part of a tensor this rank writes: its chunk, not the whole tensor (DCP's
    ``_item_size`` measures the global tensor, which made each rank believe its share was W times
    larger and cut it into W times more files)."""
    data = item.tensor_data
    n = 1
    for d in data.chunk.sizes:
        n *= d
    return n * data.properties.dtype.itemsize


def _write_result(item: Any, storage_key: str, offset: int, length: int) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, offset, length))


def _digest(raw: bytes | None) -> str:
    return "" if raw is None else hashlib.sha256(raw).hexdigest()


def _describe_publisher(raw: bytes | None, where: str) -> str:
    """Which process published a ``.metadata``, in words, for error messages."""
    if raw is None:
        return "and it has since been deleted"
    try:
        manifest = layout.manifest_of(metadata_io.load_metadata(raw, where)) or {}
        by = manifest.get("saved_by") or {}
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(by["time"])))
        return f"save {manifest.get('save_id')}: host {by['host']}, pid {by['pid']}, published {when}"
    except Exception:  # noqa: BLE001 - written by another writer or unreadable: say so
        return "by a writer that did not record itself"


def _describe_marker(volume: Volume, name: str) -> str:
    """Who wrote a save marker, in words, for error messages."""
    try:
        info = json.loads(volume.read_bytes(name) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(info["started"])))
        return f"{volume.describe(name)}: host {info['host']}, pid {info['pid']}, started {started}"
    except Exception:  # noqa: BLE001 - the marker may be gone or unreadable; its name still helps
        return volume.describe(name)


def _staging_problem(staging: Path, exc: BaseException) -> str | None:
    """A staging-disk cause behind a failed ``write_data``, in words, or None.

    DCP's serialiser reports a full disk as an opaque ``RuntimeError`` ("unexpected pos ..."), and
    a deleted staging directory as a bare ``FileNotFoundError``; the disk's state says what happened.
    (An ENOSPC alone is not enough: it may come from the volume, which has its own error message.)
    """
    if not staging.is_dir():
        return f"the staging directory {staging} disappeared during the save"
    try:
        usage = shutil.disk_usage(staging)
    except OSError:
        return None
    if usage.free < (1 << 20):
        return f"the staging directory {staging} is full ({usage.free} bytes free of {usage.total}): {exc!r}"
    return None
