"""``UCVolumeWriter``: a DCP storage writer that stages files locally and uploads them in parallel.

Where a byte goes, from ``dcp.async_save`` to the volume:

1. ``stage()``: the state dict is copied to CPU memory, every tensor once
   (:func:`~uc_checkpoint.dcp.stager.cpu_snapshot`); this is the only time training is blocked.
2. ``write_data`` (every rank, in DCP's background thread or process): the rank's items are
   serialised in DCP's file format (one ``torch.save`` archive per tensor, small ones through
   :class:`~uc_checkpoint.dcp.item_codec.ItemCodec`) into a few data files in a per-rank staging
   directory (:mod:`uc_checkpoint.dcp.serialize`). As each file is closed, it is handed to the
   rank's :class:`~uc_checkpoint.engine.upload.UploadSession`, so uploads overlap serialising the
   next file. ``write_data`` returns once every file of the rank is on the volume with its size
   checked.
3. ``finish`` (coordinator, called by DCP only after every rank's ``write_data`` succeeded): checks
   that every data file of every rank is on the volume with the right size, then publishes
   ``.metadata`` (with the file manifest inside) in one atomic write. Nothing else is ever written
   after it, except deleting data files of older saves at the same location that the new
   ``.metadata`` no longer references (:mod:`uc_checkpoint.engine.publish`).

If any rank fails, DCP never calls ``finish``: no ``.metadata`` is published, and a previous
checkpoint at the location stays loadable (new data files carry a per-save token in their names).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from uc_checkpoint.dcp import compat as dcp_compat
from uc_checkpoint.dcp import extensions, metadata_io
from uc_checkpoint.dcp.background import BACKGROUND, BackgroundSave
from uc_checkpoint.dcp.buffers import BufferLease, StagingBuffers
from uc_checkpoint.dcp.compat import StreamTransformExtension
from uc_checkpoint.dcp.location import location_is_valid, location_of, volume_location
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.dcp.serialize import (
    FileJob,
    attach_records,
    complete_metadata,
    file_queue,
    split_results,
    with_file_prefix,
    write_files,
)
from uc_checkpoint.dcp.stager import UnsupportedSnapshot, cpu_snapshot
from uc_checkpoint.engine import publish
from uc_checkpoint.engine.listing import checkpoint_files
from uc_checkpoint.engine.publish import SaveMarker
from uc_checkpoint.engine.staging_dir import create_staging_dir, staging_dir_for
from uc_checkpoint.engine.upload import UploadSession
from uc_checkpoint.errors import StagingError, UCCheckpointError
from uc_checkpoint.format import layout
from uc_checkpoint.observability import TransferRecord
from uc_checkpoint.volumes import Volume, open_volume

logger = logging.getLogger(__name__)


class UCVolumeWriter(FileSystemWriter):
    """DCP storage writer for a volume: a local or FUSE path, ``s3://bucket/prefix`` or an fsspec URL.

    Use exactly like DCP's writers, one writer object per save::

        dcp.async_save(state_dict, storage_writer=UCVolumeWriter("/mnt/vol/ckpt/step_100"))
        dcp.save(state_dict, storage_writer=UCVolumeWriter(path, options=WriterOptions(upload_workers=8)))

    Args:
        path: the checkpoint's location on the volume (a directory path or URL, or a
            :class:`~uc_checkpoint.volumes.Volume`). ``checkpoint_id=`` passed to ``dcp.save``
            replaces it: a path, a URL or a Volume; a URL of the same kind as a Volume given
            here keeps that volume's settings (its endpoint, client, part sizes).
        options: the writer's settings (:class:`~uc_checkpoint.dcp.options.WriterOptions`, where
            each is documented and checked); None: the defaults.
        staging_dir: local directory for serialised files before upload. Default:
            ``$UC_CHECKPOINT_STAGING_DIR`` or the system temp dir. Needs free space for the rank's
            share of the checkpoint at most (files are deleted as soon as they are uploaded).
        volume_options: options for the volume of a path or URL, e.g. ``{"endpoint_url": ...,
            "checksums": False}`` for S3 (see :func:`uc_checkpoint.volumes.open_volume`).
        staging_buffers: keep ``async_save``'s CPU snapshot between saves and copy the next one
            into it (:class:`~uc_checkpoint.dcp.buffers.StagingBuffers`; pass the same object to
            every writer of the run): training is blocked for a copy into mapped memory instead
            of new memory (docs/benchmarks.md, "Staging for async_save"), at the cost of one copy
            of the rank's state kept between saves. None (default): each snapshot in new memory,
            freed with its save.
        mlflow_run_id: the MLflow run this save belongs to, recorded in the manifest's
            ``saved_by`` (readable from ``.metadata`` alone); None records none.
            :class:`~uc_checkpoint.CheckpointManager` passes the run it logs to.
        single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead, overwrite:
            ``FileSystemWriter``'s keyword arguments, with the same meaning: each given replaces
            the field of the same name of ``options`` (None: as ``options`` says).
        cache_staged_state_dict: as ``FileSystemWriter``'s: True gives the writer its own
            ``staging_buffers``.
        _extensions: DCP's stream extensions, e.g. ``[ZStandard()]``, in DCP's format (stock
            readers load the checkpoint; the manifest's checksums are of the stored, transformed
            bytes). See :mod:`uc_checkpoint.dcp.extensions`.
        serialization_format: as ``FileSystemWriter``'s; other than ``TORCH_SAVE`` is refused.

    Raises (at construction):
        TypeError / ValueError: an argument of the wrong type or out of range (the options' own
            checks: :class:`~uc_checkpoint.dcp.options.WriterOptions`).

    Raises (inside DCP's ``CheckpointException``):
        VolumeError: the location is a file, not writable, or its parent is missing (local and
            fsspec volumes); the bucket does not exist or cannot be reached (S3, where a location
            is a key prefix and an object of the same name does not block it).
        LocationNotEmptyError: the location holds files that are not part of a checkpoint.
        CheckpointExistsError: ``overwrite=False`` and a checkpoint is published there.
        ConcurrentSaveError: another save at the same location started after this one, or published
            while this one ran (this one publishes nothing; see :mod:`uc_checkpoint.format.layout`).
        StagingError: the staging directory cannot be created, is full, or was deleted mid-save.
        TransferError: an upload failed or landed with the wrong size or checksum, or the
            ``.metadata`` read back after publishing is not this save's (a mount that reports a
            rename or write as done and loses it): nothing is deleted then.

    Raises (from ``reset``, ``stage``, or the first hook of a save, so from ``dcp.save`` /
    ``dcp.async_save``):
        RuntimeError: a save through this writer object is still in flight. As DCP's contract says
        (``StorageWriter.reset`` starts "a brand new checkpoint write"), one writer object serves
        one save at a time: its state (location, save id, rank, staging, claim) is that save's,
        on plain attributes as ``FileSystemWriter`` keeps them. Use one writer object per save
        (``CheckpointManager`` does); DCP's own writers let a second save through and lose one.

    A save in flight when the interpreter exits is finished first, as with DCP's own writers:
    Python joins DCP's save thread, whose pools keep working (:mod:`uc_checkpoint.volumes.workers`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Volume,
        *,
        options: WriterOptions | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        volume_options: dict[str, Any] | None = None,
        staging_buffers: StagingBuffers | None = None,
        mlflow_run_id: str | None = None,
        single_file_per_rank: bool | None = None,
        sync_files: bool | None = None,
        thread_count: int | None = None,
        per_thread_copy_ahead: int | None = None,
        cache_staged_state_dict: bool = False,
        overwrite: bool | None = None,
        _extensions: Sequence[StreamTransformExtension] | None = None,
        serialization_format: Any = None,
    ) -> None:
        if options is not None and not isinstance(options, WriterOptions):
            raise TypeError(f"options must be a WriterOptions, got {type(options).__name__}")
        given: dict[str, Any] = {
            "single_file_per_rank": single_file_per_rank,
            "sync_files": sync_files,
            "thread_count": thread_count,
            "per_thread_copy_ahead": per_thread_copy_ahead,
            "overwrite": overwrite,
        }
        given = {name: value for name, value in given.items() if value is not None}  # None: as options say
        #: The writer's settings (frozen; ``FileSystemWriter``'s keyword arguments given folded in).
        self.options = dataclasses.replace(options or WriterOptions(), **given)
        staging_buffers, base_kwargs = extensions.stock_writer_arguments(
            _extensions, cache_staged_state_dict, serialization_format, staging_buffers=staging_buffers
        )
        self._location: str | Volume = volume_location(path)
        self._volume_options: dict[str, Any] = dict(volume_options or {})
        self._volume: Volume | None = open_volume(self._location, **self._volume_options)
        o = self.options
        # Staging files are temporary: fsync there is wasted; durability is enforced on the volume.
        super().__init__(
            path=".",
            sync_files=False,
            thread_count=o.thread_count,
            per_thread_copy_ahead=o.per_thread_copy_ahead,
            overwrite=o.overwrite,
            **base_kwargs,
        )
        self.single_file_per_rank = o.single_file_per_rank  # type: ignore[assignment]  # None: sized files
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        self.staging_buffers = staging_buffers
        self.mlflow_run_id = mlflow_run_id
        #: This rank's :class:`~uc_checkpoint.observability.TransferRecord` of the last save (None before
        #: one succeeded; in DCP's PROCESS mode it stays in the background process).
        self.last_record: TransferRecord | None = None
        #: In DCP's PROCESS mode, the timeout to give the checkpoint process's own process group,
        #: which DCP creates with torch's default (30 minutes for gloo): set at each save there,
        #: before its collectives. None leaves it. ``CheckpointManager`` sets the job's timeout.
        self.process_group_timeout: timedelta | None = None
        self._created_by_pid = os.getpid()  # a copy in DCP's checkpoint process runs elsewhere
        self._lock = threading.Lock()
        self._idle()

    # ---- the save in flight -------------------------------------------------------------------
    def _idle(self) -> None:
        """No save in flight (at construction and when a save ends): the per-save attributes of the next one, as ``FileSystemWriter`` keeps
        them (``save_id``, ``rank``, ``use_collectives``, ``is_coordinator``, ``path``)."""
        #: This save's id, recorded in the manifest and ``StorageMeta``.
        self.save_id = str(uuid.uuid4())
        #: Random part of this save's data-file and marker names: a save never reuses the names of
        #: a published checkpoint's files, even when one writer object saves there twice.
        self.token = uuid.uuid4().hex[:8]
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = False
        #: This rank's staging directory while ``write_data`` runs (where DCP's serialiser writes).
        self.path: Path | None = None  # type: ignore[assignment]
        #: sha256 of the ``.metadata`` published at the location when the save started (``""``:
        #: none; None until checked): a change by ``finish`` means another save published meanwhile.
        self.published_digest: str | None = None
        # The thread running the save (None: none yet); whether reset() began it and its first
        # hook is still to come; the thread that staged it, until a thread takes it.
        self._thread: threading.Thread | None = None
        self._fresh = False
        self._staged_by: threading.Thread | None = None
        self._copying = False  # stage() is copying: no DCP save thread exists yet
        self._world_at_staging: int | None = None
        #: The kept staging buffers an async save's snapshot copied into (given back once the
        #: rank's files are serialised), its error report (None: a synchronous save, whose caller
        #: gets the error).
        self._lease: BufferLease | None = None
        self._report: BackgroundSave | None = None
        #: The claim on the location (:func:`publish.begin_save`, running in the background: the
        #: coordinator's, or each rank's in a rank-local save), and its first step's future: done
        #: once this save's marker is on the volume, what uploads wait for.
        self._claim: publish.BackgroundClaim | None = None

    def _in_flight(self) -> bool:
        """Whether a save through this writer is staged or running on another thread. A save whose
        thread ended without ending it (DCP stopped it between our hooks: its planner or another
        rank failed), or that ran on the calling thread (which runs one save at a time), is over:
        it is ended here, and a background one logged."""
        if self._staged_by is not None:
            return True
        thread = self._thread
        if thread is None:
            return False
        if thread.is_alive() and thread is not threading.current_thread():
            return True
        if self._report is not None:
            self._report.stopped_unseen()
        self._end()
        return False

    def _refuse(self, what: str) -> RuntimeError:
        where = self.volume.url
        doing = "is staged for an async save not yet started by DCP" if self._staged_by else "is in flight"
        return RuntimeError(
            f"{what}: a save through this UCVolumeWriter (pointing at {where}) {doing}; one writer object serves one "
            "save at a time (DCP's StorageWriter.reset() starts a brand new checkpoint write): use a new "
            "UCVolumeWriter for each save"
            + (
                " (if dcp.async_save raised after staging, that save never started: this writer stays reserved for it)"
                if self._staged_by is threading.current_thread()
                else ""
            )
        )

    def _begin(self, location: str | Volume | None, *, fresh: bool) -> None:
        """The calling thread starts a save (``reset``, or the first hook of a save without one),
        continues the one its ``reset`` began, or takes the one ``stage()`` prepared (on a thread
        other than the stager's: DCP's save thread).

        Raises:
            RuntimeError: another save through this writer is in flight (see the class docstring).
        """
        me = threading.current_thread()
        with self._lock:
            if self._staged_by is not None and self._staged_by is not me and not self._copying:
                # DCP's save thread (made once stage() returned) takes the save stage() prepared:
                # its lease, report and world.
                self._staged_by = None
                if self._report is not None:
                    self._report.bind()
            elif not fresh and self._fresh and self._thread is me:
                self._fresh = False  # the save this thread's reset() began
                return
            elif self._in_flight():
                raise self._refuse("reset()" if fresh else "a new save")
            if location is not None:
                self._location, self._volume = location, None
            self._thread, self._fresh = me, fresh

    def _end(self, error: BaseException | None = None) -> None:
        """This rank's part of the save is over: the interpreter's exit need not wait for it, and
        the writer may take the next save."""
        if self._lease is not None:
            self._lease.release()
        if self._claim is not None:
            self._claim.wait()  # nothing of this save runs on after it ends
        if self._report is not None:
            self._report.end(error)
        self._idle()

    @contextmanager
    def _ending_on_error(self) -> Iterator[None]:
        """End the save with the error the block raises (which goes on)."""
        try:
            yield
        except BaseException as exc:
            self._end(exc)
            raise

    # ---- identity -----------------------------------------------------------------------------
    @property
    def volume(self) -> Volume:
        """The checkpoint's location as a :class:`Volume` (created on first use, never pickled)."""
        if self._volume is None:
            options = {} if isinstance(self._location, Volume) else self._volume_options
            self._volume = open_volume(self._location, **options)
        return self._volume

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's URL on the volume (recorded as ``StorageMeta.checkpoint_id``)."""
        return self.volume.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return location_is_valid(checkpoint_id)

    def _rank(self) -> int:
        return self.rank if self.rank is not None else 0

    def __getstate__(self) -> dict[str, Any]:
        """DCP's PROCESS mode pickles the writer for its checkpoint process, on a thread of its own:
        an async save staged here goes there with the snapshot and is over here. A copy made on
        the staging thread itself (user code) takes nothing. Either way the copy is idle, at this
        writer's location, and rebuilds its volume, lock and pools."""
        with self._lock:
            staged_by = self._staged_by
            if staged_by is not None and staged_by is not threading.current_thread() and not self._copying:
                if self._lease is not None:
                    self._lease.forget()  # the snapshot's buffers go with it
                if self._report is not None:
                    self._report.end()  # its error is the other process's
                self._idle()
        state = dict(self.__dict__)
        for name in ("_lock", "_volume", "_thread", "_staged_by", "_lease", "_report", "_claim"):
            state[name] = None
        state.update(_fresh=False, _copying=False, path=None, published_digest=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self, checkpoint_id: str | os.PathLike[str] | Volume | None = None) -> None:
        """Start a brand new checkpoint write (DCP's contract), at ``checkpoint_id`` when given
        (None or "" keeps the location; any other value is checked, falsy ones such as ``{}`` or
        0 included), else where the writer points.

        Raises:
            TypeError: ``checkpoint_id`` is neither a path, a URL nor a :class:`Volume`.
            RuntimeError: a save through this writer is in flight (use one writer per save).
        """
        location = None
        if checkpoint_id is not None and not (isinstance(checkpoint_id, str) and not checkpoint_id):
            location = location_of(checkpoint_id, self._location)
        self._begin(location, fresh=True)

    # ---- staging (the only part of async_save that blocks training) --------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` to CPU memory for ``dcp.async_save``: each tensor once (DCP's own
        stager copies a DTensor's shard twice); falls back to DCP's stager for a ``ShardedTensor`` or
        another tensor subclass (other than DTensor and Parameter). The save is this writer's from
        here on; its thread takes it at its first hook.

        Raises:
            RuntimeError: a save through this writer is in flight (use one writer per save).
        """
        BACKGROUND.report()  # a save DCP stopped between our hooks is reported before the next starts
        with self._lock:
            if self._in_flight():
                raise self._refuse("stage()")
            self._staged_by, self._copying = threading.current_thread(), True
        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the snapshot is on CPU already
        lease = self.staging_buffers.lease() if self.staging_buffers is not None else None
        try:
            try:
                staged = cpu_snapshot(state_dict, lease)
            except UnsupportedSnapshot as exc:
                logger.debug("staging with DCP's stager: %s", exc)
                if lease is not None:
                    lease.cancel()
                    lease = None
                staged = super().stage(state_dict)
        except BaseException:
            if lease is not None:
                lease.cancel()
            with self._lock:
                self._staged_by, self._copying = None, False  # nothing was staged: no save follows
            raise
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        with self._lock:
            self._world_at_staging, self._lease, self._report = world, lease, BackgroundSave(self.volume.url)
            self._copying = False
        return staged

    def storage_meta(self) -> StorageMeta | None:
        """DCP's storage metadata of this save (as FileSystemWriter's)."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    # ---- planning -----------------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._begin(None, fresh=False)
        if self._report is not None:
            self._report.bind(self.volume.url)
        if self.process_group_timeout is not None and os.getpid() != self._created_by_pid:
            dcp_compat.set_default_group_timeout(self.process_group_timeout)  # that process's own group
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator
        error = _orphaned_save(self.volume.url, self._world_at_staging)
        if error is not None:
            self._end(error)
            raise error

    def _staging_path(self) -> Path:
        return staging_dir_for(self.staging_dir, "save", self.checkpoint_id, self.token, self._rank())

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        with self._ending_on_error():
            # Fail in the planning step, before anything is written anywhere: probe that staging can
            # be created (write_data creates it again), so a failed plan leaves no directory behind.
            create_staging_dir(self._staging_path()).remove()
            if self.is_coordinator or not self.use_collectives:
                # Claiming the location is a listing and two PUTs (tens of ms on an object store):
                # it runs while DCP gathers the plans and, with one writer, while its files are
                # serialised. Nothing is uploaded before its marker is there (``wait_marked``),
                # nothing published before the whole claim held (``claimed``).
                self._start_claim()
        if self.use_collectives:
            return plan
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return with_file_prefix(plan, self._rank(), self.token, self._spread_count(world))

    def _spread_count(self, world_size: int) -> int:
        """Key prefixes this save spreads its data files over (1: none; see ``spread_prefixes``)."""
        return layout.spread_count(
            self.options.spread_prefixes, world_size, partitioned_store=self.volume.partitions_by_prefix
        )

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) > 1:
            # Other ranks upload as soon as they get their plans: the marker must be there first.
            with self._ending_on_error():
                self._wait_marked()
        token, spread = self.token, self._spread_count(len(plans))
        if spread > 1:
            logger.info("spreading the data files of %s over %d key prefixes", self.volume.url, spread)
        return [p if p.storage_data is not None else with_file_prefix(p, i, token, spread) for i, p in enumerate(plans)]

    # ---- the claim on the location ------------------------------------------------------------
    def _marker(self) -> SaveMarker:
        """This save's marker; its rank is set for a rank-local save (DCP without collectives)."""
        return SaveMarker(None if self.use_collectives else self._rank(), self.token)

    def _start_claim(self) -> None:
        """Claim the location in the background (:class:`publish.BackgroundClaim`)."""
        o = self.options
        self._claim = publish.BackgroundClaim(
            self.volume, self._marker(), self.save_id, overwrite=o.overwrite, create_parents=o.create_parents
        )

    def _wait_marked(self) -> None:
        """Wait until this save's marker is on the volume (nothing of the save may be uploaded
        before); raises what claiming the location raised before that."""
        if self._claim is not None:
            self._claim.wait_marked()

    def _claimed(self) -> publish.Claim:
        """Wait until this save holds its location (:func:`publish.begin_save`, run in the
        background from the planning step) and return what claiming it found; raises what
        claiming it raised."""
        if self._claim is None:  # not the claiming rank: nothing found, nothing to check
            return publish.Claim(published="")
        found = self._claim.result()
        self.published_digest = found.published
        return found

    def _forget_staging(self) -> None:
        self.path = None

    def _release_snapshot(self) -> None:
        """Nothing of this save reads its staged tensors any more: kept buffers go back."""
        if self._lease is not None:
            self._lease.release()

    # ---- writing ------------------------------------------------------------------------------
    def _file_queue(self, plan: SavePlan, staging: Path) -> queue.Queue[FileJob]:
        single, size = self.options.single_file_per_rank, self.options.file_size_bytes
        return file_queue(plan, staging, file_size_bytes=size, threads=self.thread_count, single_file_per_rank=single)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with self._ending_on_error():
            fut = self._write_rank_data(plan, planner)
        if self.use_collectives and not self.is_coordinator:
            self._end()  # what is left on this rank is DCP's collectives, which need no pools
        return fut

    def _write_rank_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        volume = self.volume
        # A single writer claims its location while it serialises: the claim's first steps (a
        # listing and the marker's PUT, tens of ms on an object store) gate the uploads, not the
        # serialiser, which would otherwise wait for them after its first file.
        uploads = UploadSession(
            volume,
            self._staging_path(),
            workers=self.options.upload_workers,
            sync=self.options.sync_files,
            rank=self._rank(),
            before_upload=self._wait_marked,
        )
        self.path = uploads.staging
        uploads.add_done_callback(self._forget_staging)

        def upload(path: Path) -> None:
            if self._claim is not None and self._claim.done():
                self._claimed()  # a failed claim stops the serialiser at once
            uploads.submit(path)

        with uploads:  # on every way out the pool ends, the volume is closed and staging is removed
            jobs, copy_ahead = self._file_queue(plan, uploads.staging), self.per_thread_copy_ahead
            transforms = extensions.active(self.transforms)  # None without extensions: the plain path
            results = write_files(
                jobs, planner, threads=self.thread_count, copy_ahead=copy_ahead, on_closed=upload, transforms=transforms
            )
            self._release_snapshot()  # serialised: the next async save may copy into its buffers
            self._claimed()  # also when the rank had nothing to upload
            records, record = uploads.finish()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(attach_records(results, records, volume.url_of))
        self.last_record = record
        logger.info("%s", record.describe())
        return fut

    # ---- publishing ---------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self._ending_on_error():
            self._finish(metadata, results)
        self._end()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        claim = self._claimed()
        volume, marker = self.volume, self._marker()
        storage_md, records = split_results(results)
        # Files this process uploaded to a volume that verified every upload (S3) are not listed
        # again: one LIST per 1,000 files (and per spread prefix) between the last upload and the
        # publish, where the claim's HEAD tells what the listing's markers told. Other ranks' files
        # are listed, as on every other volume (local, FUSE, fsspec): a rank whose store settings
        # differ (another endpoint on one node) verified its uploads against another store.
        own_files_only = len(results) == 1
        listing = None if volume.verifies_uploads and own_files_only else checkpoint_files(volume)
        referenced = {info.relative_path for info in storage_md.values()}
        publish.check_data_files(volume, listing, {name: r.size for name, r in records.items()}, referenced)
        try:
            meta_name = marker.metadata_name()
            read_manifest = _manifest_reader(volume.url_of(meta_name))
            args = (volume, meta_name, listing, self.published_digest, read_manifest)
            # Unlisted (S3), the claim's HEAD and the published .metadata's HEAD are independent:
            # sent together, they cost the publish one round trip instead of two.
            published = publish.in_background(publish.read_published, *args) if listing is None else None
            try:
                # The claim alone says which save publishes: a second judge (the newest marker by
                # the store's clock, of one-second resolution on S3) could disagree and refuse both.
                publish.check_claim(volume, marker, claim)
            finally:
                if published is not None:
                    concurrent.futures.wait([published])  # nothing of this save runs on after it
            complete_metadata(
                metadata, storage_md, self.storage_meta(), self.save_id, records.values(), self.mlflow_run_id
            )
            current = published.result() if published is not None else publish.read_published(*args)
            superseded = _files_of_published(volume, meta_name, current)
            blob = metadata_io.dump_metadata(metadata)
            publish.publish_metadata(
                volume, meta_name, blob, overwrite=self.options.overwrite, read_manifest=read_manifest, replaced=current
            )
            logger.info("published %s (%d data files)", volume.url_of(meta_name), len(records))
            # A rollback's abandonment marker annotated the checkpoint just replaced (uc_checkpoint.ops.lineage).
            abandoned = claim.abandoned if listing is None else layout.ABANDONED_NAME in listing
            stale = {layout.ABANDONED_NAME} if marker.rank is None and abandoned else set()
            publish.remove_superseded(volume, (superseded - set(records)) | stale)
        finally:
            marker.remove(volume)


def _orphaned_save(url: str, world: int | None) -> StagingError | None:
    """The error for an async save staged by ``world`` ranks whose process group is gone by the
    time it runs, else None. DCP decides "no process group, save alone" when the background save
    starts: a group destroyed meanwhile would have each rank publish its own share as the whole
    checkpoint."""
    if world is not None and world > 1 and not (dist.is_available() and dist.is_initialized()):
        return StagingError(
            f"save to {url} abandoned: it was started by {world} ranks, but the process group "
            "was destroyed before it ran (call CheckpointManager.wait() or the save's future .result() "
            "before dist.destroy_process_group()); nothing is published"
        )
    return None


def _manifest_reader(where: str) -> publish.ManifestReader:
    """How :mod:`uc_checkpoint.engine.publish` reads the manifest of a ``.metadata`` at ``where``."""
    return lambda raw: metadata_io.manifest_of(metadata_io.load_metadata(raw, where))


def _files_of_published(volume: Volume, meta_name: str, raw: bytes | None) -> set[str]:
    """Data files the ``.metadata`` about to be replaced (``raw``) references (empty when it
    cannot be read: then nothing is deleted and garbage collection deals with the files later)."""
    if raw is None:
        return set()
    try:
        old = metadata_io.load_metadata(raw, volume.url_of(meta_name))
    except UCCheckpointError as exc:
        logger.warning("not deleting the data files of the replaced checkpoint: %s", exc)
        return set()
    return metadata_io.data_file_names(old)
