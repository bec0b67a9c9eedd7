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
import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from uc_checkpoint.dcp import compat as dcp_compat
from uc_checkpoint.dcp import extensions, metadata_io
from uc_checkpoint.dcp.buffers import BufferLease, StagingBuffers
from uc_checkpoint.dcp.compat import StreamTransformExtension
from uc_checkpoint.dcp.handover import BACKGROUND, BackgroundSave, Handover, StagedSave
from uc_checkpoint.dcp.serialize import (
    FileJob,
    attach_records,
    complete_metadata,
    file_queue,
    split_results,
    with_file_prefix,
    write_files,
)
from uc_checkpoint.dcp.sessions import Session, SessionOwner, check_types
from uc_checkpoint.dcp.stager import UnsupportedSnapshot, cpu_snapshot
from uc_checkpoint.engine import publish
from uc_checkpoint.engine.listing import checkpoint_files
from uc_checkpoint.engine.publish import SaveMarker
from uc_checkpoint.engine.staging_dir import create_staging_dir, staging_dir_for
from uc_checkpoint.engine.upload import UploadSession
from uc_checkpoint.errors import StagingError, UCCheckpointError
from uc_checkpoint.format import layout
from uc_checkpoint.observability import TransferRecord
from uc_checkpoint.volumes import Volume

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _new_token() -> str:
    return uuid.uuid4().hex[:8]


@dataclass
class _SaveSession(Session):
    """One save on one rank (see :mod:`uc_checkpoint.dcp.sessions`).

    Attributes:
        token: random part of this save's data-file and marker names, so a save never reuses the
            names of a published checkpoint's files, even when one writer object saves twice.
        save_id: recorded in the manifest and ``StorageMeta``.
        published_digest: sha256 of the ``.metadata`` published at the location when the save
            started (``""`` for none; None until checked): a change by ``finish`` means another save
            published meanwhile.
        staging: this rank's staging directory while ``write_data`` runs.
        report: an async save's error report (:class:`~uc_checkpoint.dcp.handover.BackgroundSave`),
            None for a synchronous one, whose caller gets the error.
        staged: an async save's staging, taken by its thread's first hook and used at set-up.
        claim: the claim on the location (:func:`publish.begin_save`, running in the background;
            the coordinator's, or each rank's in a rank-local save), None on other ranks.
        marked: done once the claim's first step put this save's marker on the volume (or
            failed): what uploads wait for. None where ``claim`` is.
        lease: the kept staging buffers the async save's snapshot copied into, given back once
            the rank's files are serialised (:class:`~uc_checkpoint.dcp.buffers.BufferLease`).
    """

    token: str = field(default_factory=_new_token)
    save_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    is_coordinator: bool = False
    published_digest: str | None = None
    staging: Path | None = None
    report: BackgroundSave | None = None
    staged: StagedSave | None = None
    claim: concurrent.futures.Future[publish.Claim] | None = None
    marked: concurrent.futures.Future[None] | None = None
    lease: BufferLease | None = None

    def start_claim(self, volume: Volume, *, overwrite: bool, create_parents: bool) -> None:
        """Claim the location in the background (:func:`publish.begin_save`): ``marked`` is
        settled when the marker is on the volume, ``claim`` when the whole claim is."""
        marked: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.marked = marked
        self.claim = _in_background(
            publish.begin_save,
            volume,
            self.marker(),
            self.save_id,
            overwrite=overwrite,
            create_parents=create_parents,
            on_marked=lambda: marked.set_result(None),
        )
        # Runs on the claiming thread once it is done: a claim refused before its marker was
        # written hands its error to whoever waits for the marker.
        self.claim.add_done_callback(lambda claim: _settle_marked(marked, claim))

    def wait_marked(self) -> None:
        """Wait until this save's marker is on the volume (nothing of the save may be uploaded
        before); raises what claiming the location raised before that."""
        if self.marked is not None:
            self.marked.result()

    def claimed(self) -> publish.Claim:
        """Wait until this save holds its location (:func:`publish.begin_save`, run in the
        background from the planning step) and return what claiming it found; raises what
        claiming it raised."""
        if self.claim is None:  # not the claiming rank: nothing found, nothing to check
            return publish.Claim(published="")
        found = self.claim.result()
        self.published_digest = found.published
        return found

    def marker(self) -> SaveMarker:
        """This save's marker; its rank is set for a rank-local save (DCP without collectives)."""
        return SaveMarker(None if self.use_collectives else (self.rank or 0), self.token)

    def forget_staging(self) -> None:
        self.staging = None

    def release_snapshot(self) -> None:
        """Nothing of this save reads its staged tensors any more: kept buffers go back."""
        if self.lease is not None:
            self.lease.release()

    def end(self, error: BaseException | None = None) -> None:
        """This rank's part of the save is over: the interpreter's exit need not wait for it."""
        self.release_snapshot()
        if self.claim is not None:
            concurrent.futures.wait([self.claim])  # nothing of this save runs on after it ends
        if self.report is not None:
            self.report.end(error)

    @contextmanager
    def ending_on_error(self) -> Iterator[None]:
        """End the save with the error the block raises (which goes on)."""
        try:
            yield
        except BaseException as exc:
            self.end(exc)
            raise


class UCVolumeWriter(SessionOwner, FileSystemWriter):
    """DCP storage writer for a volume: a local or FUSE path, ``s3://bucket/prefix`` or an fsspec URL.

    Use exactly like DCP's writers::

        dcp.async_save(state_dict, storage_writer=UCVolumeWriter("/mnt/vol/ckpt/step_100"))
        dcp.save(state_dict, storage_writer=UCVolumeWriter(path))

    Args:
        path: the checkpoint's location on the volume (a directory path or URL, or a
            :class:`~uc_checkpoint.volumes.Volume`). ``checkpoint_id=`` passed to ``dcp.save``
            replaces it: a path, a URL or a Volume; a URL of the same kind as a Volume given
            here keeps that volume's settings (its endpoint, client, part sizes).
        staging_dir: local directory for serialised files before upload. Default:
            ``$UC_CHECKPOINT_STAGING_DIR`` or the system temp dir. Needs free space for the rank's
            share of the checkpoint at most (files are deleted as soon as they are uploaded).
        upload_workers: files uploaded at once per rank.
        thread_count: DCP serialisation threads per rank.
        file_size_bytes: target size of one data file in bytes; smaller files start uploading
            sooner but cost more requests. None (default): :func:`~uc_checkpoint.dcp.serialize.auto_file_size` of the rank's share
            (about 16 files, 16-256 MiB each).
        overwrite: allow replacing a checkpoint already published at ``path``. The old checkpoint
            stays loadable until the new ``.metadata`` replaces it.
        create_parents: create missing parent directories of a local ``path``.
        sync_files: fsync data files and ``.metadata`` on the volume before publishing.
        volume_options: options for the volume of a path or URL, e.g. ``{"endpoint_url": ...,
            "checksums": False}`` for S3 (see :func:`uc_checkpoint.volumes.open_volume`).
        spread_prefixes: spread the data files over this many key prefixes inside the location
            (1 to 256): rank ``r``'s files go to ``<r % spread_prefixes in hex>/__<r>_...distcp``,
            so that a store which limits requests per prefix (S3: about 3,500 writes/s before
            ``503 SlowDown``) serves a save of thousands of ranks from several partitions. 1: the
            flat layout. None (default): automatic: flat, except on S3 for saves of at least
            256 ranks, which get one prefix per 32 ranks (8 at 256 ranks, at most 256). Stock DCP
            readers load either layout (``.metadata`` records each file's relative path).
        staging_buffers: keep ``async_save``'s CPU snapshot between saves and copy the next one
            into it (:class:`~uc_checkpoint.dcp.buffers.StagingBuffers`; pass the same object to
            every writer of the run): training is blocked for a copy into mapped memory instead
            of new memory (docs/benchmarks.md, "Staging for async_save"), at the cost of one copy of the rank's
            state kept between saves. None (default): each snapshot in new memory, freed with its
            save.
        mlflow_run_id: the MLflow run this save belongs to, recorded in the manifest's
            ``saved_by`` (readable from ``.metadata`` alone); None records none.
            :class:`~uc_checkpoint.CheckpointManager` passes the run it logs to.
        _extensions: DCP's stream extensions, e.g. ``[ZStandard()]``, in DCP's format (stock readers
            load the checkpoint; the manifest's checksums are of the stored, transformed bytes).
        single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict, serialization_format:
            as ``FileSystemWriter``'s (keyword arguments only, like every other one, which mean the
            same here): ``single_file_per_rank`` True gives ``thread_count`` files per rank, False
            one per item (default None: files of ``file_size_bytes``); ``cache_staged_state_dict``
            gives the writer its own ``staging_buffers``; ``serialization_format`` other than
            ``TORCH_SAVE`` is refused. See :mod:`uc_checkpoint.dcp.extensions`.

    Raises (at construction):
        TypeError / ValueError: an argument of the wrong type or out of range.

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

    One writer object may serve several saves at once (overlapping ``dcp.async_save`` calls, each
    with its own ``checkpoint_id``): each save's state is its own (:mod:`uc_checkpoint.dcp.sessions`),
    and an async save's staging reaches its thread through :mod:`uc_checkpoint.dcp.handover`. A
    save in flight when the interpreter exits is finished first, as with DCP's own writers: Python
    joins DCP's save thread, whose pools keep working (:mod:`uc_checkpoint.volumes.workers`).
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
        spread_prefixes: int | None = None,
        staging_buffers: StagingBuffers | None = None,
        mlflow_run_id: str | None = None,
        _extensions: Sequence[StreamTransformExtension] | None = None,
        single_file_per_rank: bool | None = None,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        serialization_format: Any = None,
    ) -> None:
        _check_arguments(path, upload_workers, thread_count, file_size_bytes, spread_prefixes)
        staging_buffers, base_kwargs = extensions.stock_writer_arguments(
            _extensions,
            single_file_per_rank,
            per_thread_copy_ahead,
            cache_staged_state_dict,
            serialization_format,
            file_size_bytes=file_size_bytes,
            staging_buffers=staging_buffers,
        )
        self._init_sessions(path, volume_options)
        #: Where an async save's staging waits for its thread (:mod:`uc_checkpoint.dcp.handover`).
        self.handover = Handover()
        # Staging files are temporary: fsync there is wasted; durability is enforced on the volume.
        super().__init__(path=".", sync_files=False, thread_count=thread_count, overwrite=overwrite, **base_kwargs)
        self.single_file_per_rank = single_file_per_rank  # type: ignore[assignment]  # None: sized files
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        self.upload_workers = upload_workers
        self.file_size_bytes = file_size_bytes
        self.create_parents = create_parents
        self.sync_volume = sync_files
        self.spread_prefixes = spread_prefixes
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
        # DCP's PROCESS mode pickles the writer for its checkpoint process: a save staged here
        # continues there (the Handover itself pickles empty).
        self.handover.take_for_pickle()
        return super().__getstate__()

    def reset(self, checkpoint_id: str | os.PathLike[str] | Volume | None = None) -> None:
        # DCP's first hook on an async save's thread when the save names a checkpoint_id.
        staged = self._take_staged()
        session = self._reset_location(checkpoint_id)
        assert isinstance(session, _SaveSession)
        session.staged = staged

    # ---- staging (the only part of async_save that blocks training) --------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` to CPU memory for ``dcp.async_save``: each tensor once (DCP's own
        stager copies a DTensor's shard twice); falls back to DCP's stager for a ``ShardedTensor`` or
        another tensor subclass (other than DTensor and Parameter)."""
        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the snapshot is on CPU already
        BACKGROUND.report()  # a save DCP stopped between our hooks is reported before the next starts
        # Where this thread's saves go, as async_save was called: its last reset(checkpoint_id), as
        # for its synchronous saves, else the writer's; taken before the copy, during which another
        # thread's reset may move the writer.
        mine = self._own_session()
        location = mine.location if mine is not None else self._location
        lease = self.staging_buffers.lease() if self.staging_buffers is not None else None
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
            raise
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        self.handover.put(StagedSave(location, world, threading.current_thread(), lease))
        return staged

    def _take_staged(self) -> StagedSave | None:
        """The staging of the async save this thread runs: kept by its session since an earlier hook,
        else taken from the :class:`Handover` (on DCP's save thread only, see
        :mod:`uc_checkpoint.dcp.handover`); None for a synchronous save, on whatever thread. A
        staging taken here starts this thread's session at the location it was staged for."""
        mine = self._own_session()
        if mine is not None:
            # This thread's save has begun (DCP makes a thread per async save): a later hook, such
            # as finish's storage_meta, must not take the next save's staging.
            return mine.staged if isinstance(mine, _SaveSession) else None
        staged = self.handover.take()
        if staged is not None:
            session = self._new_session(staged.location, fresh=True)
            assert isinstance(session, _SaveSession)
            session.staged = staged
        return staged

    def storage_meta(self) -> StorageMeta | None:
        """DCP's storage metadata of this save (as FileSystemWriter's). An async save's thread
        takes its staging here if it has not yet (:meth:`_take_staged`)."""
        self._take_staged()
        return super().storage_meta()

    # ---- planning -----------------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        staged = self._take_staged()
        save = self._begin_session(None if staged is None else staged.location)
        assert isinstance(save, _SaveSession)
        save.staged = None
        if staged is not None:
            save.lease, save.report = staged.lease, staged.report
            save.report.bind(save.volume.url)
        if self.process_group_timeout is not None and os.getpid() != self._created_by_pid:
            dcp_compat.set_default_group_timeout(self.process_group_timeout)  # that process's own group
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        save.is_coordinator = is_coordinator
        error = _orphaned_save(save.volume.url, None if staged is None else staged.world_size)
        if error is not None:
            save.end(error)
            raise error

    def _staging_path(self) -> Path:
        return staging_dir_for(self.staging_dir, "save", self.checkpoint_id, self._save.token, self._rank())

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        save = self._save
        with save.ending_on_error():
            # Fail in the planning step, before anything is written anywhere: probe that staging can
            # be created (write_data creates it again), so a failed plan leaves no directory behind.
            create_staging_dir(self._staging_path()).remove()
            if self.is_coordinator or not self.use_collectives:
                # Claiming the location is a listing and two PUTs (tens of ms on an object store):
                # it runs while DCP gathers the plans and, with one writer, while its files are
                # serialised. Nothing is uploaded before its marker is there (``wait_marked``),
                # nothing published before the whole claim held (``claimed``).
                save.start_claim(self.volume, overwrite=self.overwrite, create_parents=self.create_parents)
        if self.use_collectives:
            return plan
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return with_file_prefix(plan, self._rank(), save.token, self._spread_count(world))

    def _spread_count(self, world_size: int) -> int:
        """Key prefixes this save spreads its data files over (1: none; see ``spread_prefixes``)."""
        return layout.spread_count(self.spread_prefixes, world_size, partitioned_store=self.volume.partitions_by_prefix)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) > 1:
            # Other ranks upload as soon as they get their plans: the marker must be there first.
            with self._save.ending_on_error():
                self._save.wait_marked()
        token, spread = self._save.token, self._spread_count(len(plans))
        if spread > 1:
            logger.info("spreading the data files of %s over %d key prefixes", self.volume.url, spread)
        return [p if p.storage_data is not None else with_file_prefix(p, i, token, spread) for i, p in enumerate(plans)]

    # ---- writing ------------------------------------------------------------------------------
    def _file_queue(self, plan: SavePlan, staging: Path) -> queue.Queue[FileJob]:
        single, size = self.single_file_per_rank, self.file_size_bytes
        return file_queue(plan, staging, file_size_bytes=size, threads=self.thread_count, single_file_per_rank=single)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with self._save.ending_on_error():
            fut = self._write_rank_data(plan, planner)
        if self.use_collectives and not self.is_coordinator:
            self._save.end()  # what is left on this rank is DCP's collectives, which need no pools
        return fut

    def _write_rank_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save, volume = self._save, self.volume
        # A single writer claims its location while it serialises: the claim's first steps (a
        # listing and the marker's PUT, tens of ms on an object store) gate the uploads, not the
        # serialiser, which would otherwise wait for them after its first file.
        uploads = UploadSession(
            volume,
            self._staging_path(),
            workers=self.upload_workers,
            sync=self.sync_volume,
            rank=self._rank(),
            before_upload=save.wait_marked,
        )
        save.staging = uploads.staging
        uploads.add_done_callback(save.forget_staging)

        def upload(path: Path) -> None:
            if save.claim is not None and save.claim.done():
                save.claimed()  # a failed claim stops the serialiser at once
            uploads.submit(path)

        with uploads:  # on every way out the pool ends, the volume is closed and staging is removed
            jobs, copy_ahead = self._file_queue(plan, uploads.staging), self.per_thread_copy_ahead
            transforms = extensions.active(self.transforms)  # None without extensions: the plain path
            results = write_files(
                jobs, planner, threads=self.thread_count, copy_ahead=copy_ahead, on_closed=upload, transforms=transforms
            )
            save.release_snapshot()  # serialised: the next async save may copy into its buffers
            save.claimed()  # also when the rank had nothing to upload
            records, record = uploads.finish()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(attach_records(results, records, volume.url_of))
        self.last_record = record
        logger.info("%s", record.describe())
        return fut

    # ---- publishing ---------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self._save.ending_on_error():
            self._finish(metadata, results)
        self._save.end()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        claim = self._save.claimed()
        volume, marker = self.volume, self._save.marker()
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
            args = (volume, meta_name, listing, self._save.published_digest, read_manifest)
            # Unlisted (S3), the claim's HEAD and the published .metadata's HEAD are independent:
            # sent together, they cost the publish one round trip instead of two.
            published = _in_background(publish.read_published, *args) if listing is None else None
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
                volume, meta_name, blob, overwrite=self.overwrite, read_manifest=read_manifest, replaced=current
            )
            logger.info("published %s (%d data files)", volume.url_of(meta_name), len(records))
            # A rollback's abandonment marker annotated the checkpoint just replaced (uc_checkpoint.ops.lineage).
            abandoned = claim.abandoned if listing is None else layout.ABANDONED_NAME in listing
            stale = {layout.ABANDONED_NAME} if marker.rank is None and abandoned else set()
            publish.remove_superseded(volume, (superseded - set(records)) | stale)
        finally:
            marker.remove(volume)


def _in_background(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[_T]:
    """Run ``fn`` on a new daemon thread (named for it); its result or exception comes back
    through the future."""
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name=f"uc-{getattr(fn, '__name__', 'save')}", daemon=True).start()
    return future


def _settle_marked(marked: concurrent.futures.Future[None], claim: concurrent.futures.Future[publish.Claim]) -> None:
    """Settle ``marked`` from the finished ``claim`` unless the marker's step already did: with
    the claim's error when it failed before writing the marker."""
    if marked.done():
        return
    error = claim.exception()
    if error is None:
        marked.set_result(None)
    else:
        marked.set_exception(error)


def _check_arguments(
    path: object, upload_workers: object, thread_count: object, file_size_bytes: object, spread_prefixes: object
) -> None:
    """The writer's argument checks: TypeError for a wrong type, then ValueError for a value below 1
    (or ``spread_prefixes`` above :data:`~uc_checkpoint.format.layout.MAX_SPREAD_PREFIXES`)."""
    counts = {
        "upload_workers": upload_workers,
        "thread_count": thread_count,
        "file_size_bytes": 1 if file_size_bytes is None else file_size_bytes,
        "spread_prefixes": 1 if spread_prefixes is None else spread_prefixes,
    }
    check_types(path, counts)
    for arg, value in counts.items():
        if value < 1:  # type: ignore[operator]  # an int, checked above
            raise ValueError(f"{arg} must be >= 1, got {value}")
    if isinstance(spread_prefixes, int) and spread_prefixes > layout.MAX_SPREAD_PREFIXES:
        raise ValueError(f"spread_prefixes must be <= {layout.MAX_SPREAD_PREFIXES}, got {spread_prefixes}")


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
