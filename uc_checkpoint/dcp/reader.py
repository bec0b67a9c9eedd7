"""``UCVolumeReader``: a DCP storage reader that fetches only the files a load needs, in parallel,
into a local staging cache, and deserialises each file as soon as it has arrived and been verified.

The class follows DCP's call sequence (``read_metadata``, ``set_up_storage_reader``,
``prepare_local_plan``/``prepare_global_plan``, ``read_data``) and delegates the work:

- :mod:`uc_checkpoint.dcp.metadata_io` decodes and checks ``.metadata``;
- :mod:`uc_checkpoint.engine.fetch` fetches whole files into staging or byte ranges into memory,
  verified, within a memory budget;
- :mod:`uc_checkpoint.dcp.items` decodes each item into the load plan, as DCP's
  ``FileSystemReader`` does (``torch.load`` of each tensor item, then copied into the load plan's
  tensor), except that small tensor items written by our writer (or by ``torch.save`` of a plain
  tensor) are decoded by :class:`~uc_checkpoint.dcp.item_codec.ItemCodec`.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from uc_checkpoint.dcp import extensions, metadata_io
from uc_checkpoint.dcp.compat import ExtensionRegistry, _StorageInfo
from uc_checkpoint.dcp.items import ChunkShapes, ItemLoader, chunk_shapes
from uc_checkpoint.dcp.location import location_is_valid, location_of, volume_location
from uc_checkpoint.dcp.options import ReaderOptions
from uc_checkpoint.engine.fetch import fetch_files, fetch_ranges
from uc_checkpoint.engine.ranges import DEFAULT_MAX_RANGE_BYTES, plan_ranges
from uc_checkpoint.engine.staging_dir import staging_dir_for
from uc_checkpoint.errors import CheckpointNotFoundError, UCCheckpointError
from uc_checkpoint.format import layout
from uc_checkpoint.format.integrity import FileRecord
from uc_checkpoint.observability import TransferRecord
from uc_checkpoint.volumes import Volume, open_volume

logger = logging.getLogger(__name__)

_MISSING_ATTR = "_uc_missing"


class UCVolumeReader(FileSystemReader):
    """DCP storage reader for a checkpoint written to a volume by :class:`UCVolumeWriter` (or by
    DCP's own ``FileSystemWriter`` on a local path).

    Use exactly like DCP's readers, one reader object per load::

        dcp.load(state_dict, storage_reader=UCVolumeReader("/mnt/vol/ckpt/step_100"))

    Args:
        path: the checkpoint's location (directory path or URL, or a
            :class:`~uc_checkpoint.volumes.Volume`); ``checkpoint_id=`` replaces it (a URL of the
            same kind as a Volume given here keeps that volume's settings, as for the writer).
        options: the reader's settings (:class:`~uc_checkpoint.dcp.options.ReaderOptions`, where
            each is documented and checked); None: the defaults.
        staging_dir: local cache for fetched files (default ``$UC_CHECKPOINT_STAGING_DIR`` or the
            system temp dir); each file is deleted once deserialised.
        volume_options: options for the volume of a path or URL (see
            :func:`uc_checkpoint.volumes.open_volume`).
        _extension_registry: as ``FileSystemReader``'s (DCP's stream extensions): the registry
            that rebuilds the extensions an item was written with (``ZStandard``, a user's
            transform) from its descriptors. None (default): DCP's default registry (ZStandard
            only). A transformed item is fetched whole, checked against the manifest's checksums
            of the stored bytes, then untransformed (:mod:`uc_checkpoint.dcp.extensions`).

    Raises (inside DCP's ``CheckpointException``):
        VolumeError: the location is a file, or its bucket does not exist.
        CheckpointNotFoundError: no ``.metadata`` at the location.
        CorruptCheckpointError: ``.metadata`` cannot be read or names a data file outside the
            checkpoint, or a data file is missing, truncated or fails its checksum. The message
            names the file.
        UnsafeMetadataError: (a ``CorruptCheckpointError``) ``.metadata`` names a global that is not
            part of DCP's metadata format; the message names it.
        ValueError: items the load needs were written with an extension the registry cannot
            rebuild (raised before anything is fetched; the message says how to register it).
        RuntimeError: a load through this reader object is in flight on another thread: the
            load's state (``storage_data``, ``load_id``, what ``.metadata`` said) is on the
            object, as ``FileSystemReader`` keeps it; use one reader object per load.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Volume,
        *,
        options: ReaderOptions | None = None,
        staging_dir: str | os.PathLike[str] | None = None,
        volume_options: dict[str, Any] | None = None,
        _extension_registry: ExtensionRegistry | None = None,
    ) -> None:
        if options is not None and not isinstance(options, ReaderOptions):
            raise TypeError(f"options must be a ReaderOptions, got {type(options).__name__}")
        #: The reader's settings (frozen).
        self.options = options or ReaderOptions()
        registry = extensions.check_registry(_extension_registry)
        self._location: str | Volume = volume_location(path)
        self._volume_options: dict[str, Any] = dict(volume_options or {})
        self._volume: Volume | None = open_volume(self._location, **self._volume_options)
        super().__init__(path=".", **({} if registry is None else {"_extension_registry": registry}))
        self.path = None  # type: ignore[assignment]  # FileSystemReader's: every read goes through the volume
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        #: This rank's :class:`~uc_checkpoint.observability.TransferRecord` of the last load (None before one).
        self.last_record: TransferRecord | None = None
        #: The manifest of the checkpoint this reader last set up a load of (None before one, or for
        #: a checkpoint without one): ``saved_by`` says who saved it (:mod:`uc_checkpoint.format.layout`).
        self.last_manifest: Mapping[str, Any] | None = None
        self._lock = threading.Lock()
        self._idle()

    # ---- the load in flight -------------------------------------------------------------------
    def _idle(self) -> None:
        """No load in flight: the per-load attributes of the next one (``storage_data`` and
        ``load_id`` as ``FileSystemReader`` keeps them, and what ``.metadata`` said)."""
        self.storage_data: dict[Any, _StorageInfo] = {}
        self.load_id = str(uuid.uuid4())
        self.rank = None
        self.use_collectives = True
        self.records: dict[str, FileRecord] = {}
        self.min_sizes: dict[str, int] = {}
        self.chunks: ChunkShapes = {}  # what each tensor item holds, for ItemCodec
        self._metadata_error: UCCheckpointError | None = None
        # The thread running the load (None: none), and whether its reset() began it.
        self._thread: threading.Thread | None = None
        self._fresh = False

    def _begin(self, location: str | Volume | None, *, fresh: bool) -> None:
        """The calling thread starts a load (``reset``, or ``read_metadata`` of a load without one),
        or continues the one its ``reset`` began.

        Raises:
            RuntimeError: a load through this reader is in flight on another thread.
        """
        me = threading.current_thread()
        with self._lock:
            if not fresh and self._fresh and self._thread is me:
                self._fresh = False
                return
            self._check_not_busy()
            self._idle()
            if location is not None:
                self._location, self._volume = location, None
            self._thread, self._fresh = me, fresh

    def _check_not_busy(self) -> None:
        """Raises RuntimeError when a load through this reader runs on another (live) thread."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            raise self._refusal(f"is in flight on thread {thread.name}")

    def _refusal(self, state: str) -> RuntimeError:
        return RuntimeError(
            f"a load through this UCVolumeReader (from {self.volume.url}) {state}; its state is the reader's "
            "(as FileSystemReader's): use a new UCVolumeReader for each load"
        )

    def _end(self) -> None:
        """The load is over on this rank: another thread may use the reader."""
        with self._lock:
            self._thread = None

    @contextmanager
    def _ending_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self._end()
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
        """The checkpoint's URL on the volume."""
        return self.volume.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return location_is_valid(checkpoint_id)

    def _rank(self) -> int:
        return self.rank if self.rank is not None else 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_lock=None, _volume=None, _thread=None, _fresh=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self, checkpoint_id: str | os.PathLike[str] | Volume | None = None) -> None:
        """Start a new load, at ``checkpoint_id`` when given (as the writer's ``reset``).

        Raises:
            TypeError: ``checkpoint_id`` is neither a path, a URL nor a :class:`Volume`.
            RuntimeError: a load through this reader is in flight on another thread.
        """
        location = None
        if checkpoint_id is not None and not (isinstance(checkpoint_id, str) and not checkpoint_id):
            location = location_of(checkpoint_id, self._location)
        self._begin(location, fresh=True)

    # ---- metadata -----------------------------------------------------------------------------
    def load_metadata(self, rank: int | None = None) -> Metadata:
        """Fetch, decode and check ``.metadata`` (or ``__<rank>.metadata``), see
        :func:`uc_checkpoint.dcp.metadata_io.read_metadata`.

        Raises:
            CheckpointNotFoundError: the file does not exist.
            UnsafeMetadataError: it names a global outside the allow-list (and
                ``allow_unsafe_metadata`` is False).
            CorruptCheckpointError: it exists but is not a DCP ``Metadata`` pickle, or it names a
                data file outside the checkpoint location.
        """
        return metadata_io.read_metadata(self.volume, rank, allow_unsafe=self.options.allow_unsafe_metadata)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None:  # DCP's first call of a load (a retry for rank-local metadata passes rank)
            self._begin(None, fresh=False)
        elif self._thread is not threading.current_thread():
            # DCP's retry after this thread's first call was refused: refused again, leaving the
            # load that holds the reader be.
            raise self._refusal("was in flight on another thread when this load began")
        try:
            metadata = self.load_metadata(rank)
        except UCCheckpointError as exc:  # the load goes on to set_up_storage_reader, which raises it
            if rank is None:
                self._metadata_error = exc  # DCP retries with rank (below)
                raise
            # DCP retries with rank-local metadata and, when that fails too, replaces our error with
            # a bare AssertionError. Hand it a placeholder so that set_up_storage_reader raises the
            # error of the global .metadata instead.
            placeholder = Metadata(state_dict_metadata={})
            setattr(placeholder, _MISSING_ATTR, True)
            return placeholder
        except BaseException:
            if rank is not None:  # the retry failed too: DCP raises, this load is over
                self._end()
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        with self._ending_on_error():
            if getattr(metadata, _MISSING_ATTR, False):
                raise self._metadata_error or CheckpointNotFoundError(f"no checkpoint at {self.volume.url}")
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self.last_manifest = metadata_io.manifest_of(metadata)
            self.records = layout.manifest_records(self.last_manifest)
            self.min_sizes = metadata_io.referenced_files(metadata)
            self.chunks = chunk_shapes(metadata)

    # ---- data ---------------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch the bytes of ``plan``'s items (ranges or whole files, see ``prefetch_files``) and
        decode each item into ``planner`` as soon as its bytes have arrived and been verified
        (:mod:`uc_checkpoint.engine.fetch`, :mod:`uc_checkpoint.dcp.items`)."""
        try:
            return self._read_data(plan, planner)
        finally:
            self._end()

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        volume, rank, o = self.volume, self._rank(), self.options
        stored = (self.storage_data[item.storage_index].transform_descriptors for item in plan.items)
        extensions.check_readable(self.transforms, stored, volume.url)
        ranged = volume.prefers_ranged_reads if o.prefetch_files is None else not o.prefetch_files
        items = ItemLoader(
            volume,
            planner,
            self.storage_data,
            self.chunks,
            transforms=getattr(self, "transforms", None),
            check_archive_crc=not self.records and o.verify_checksums,
        )
        # What each file holds: its recorded size, else the bytes its items need.
        sizes = {**self.min_sizes, **{name: rec.size for name, rec in self.records.items()}}
        if ranged:
            # Only the byte ranges the plan needs, widened to checksum blocks when verifying.
            records = self.records if o.verify_checksums else {}
            requests = plan_ranges(
                items.spans(plan.items),
                file_sizes=sizes,
                block_sizes={name: rec.block_size for name, rec in records.items()},
                gap_bytes=o.range_gap_bytes,
                max_range_bytes=max(DEFAULT_MAX_RANGE_BYTES, o.range_chunk_bytes),
            )
            # Largest first (LPT scheduling, Graham 1969): the long transfers start while the pool
            # is still starting up, and the short ones fill in around them, so the last one ends sooner.
            requests.sort(key=lambda req: req.nbytes, reverse=True)
            items.place(plan.items)  # large tensors' bytes go straight into their targets
            stats = fetch_ranges(
                volume,
                requests,
                lambda req, data: items.load_range(req.items, req.start, data),
                in_place=lambda req: items.received_in_place(req.items),
                records=records,
                chunk_bytes=o.range_chunk_bytes,
                max_inflight_bytes=o.max_inflight_bytes,
                workers=o.download_workers,
                thread_name=f"uc-range-r{rank}",
            )
        else:
            by_file = items.by_file(plan.items).items()  # largest first, as above
            per_file = dict(sorted(by_file, key=lambda kv: sizes.get(kv[0], 0), reverse=True))
            stats = fetch_files(
                volume,
                per_file,
                staging_dir_for(self.staging_dir, "load", volume.url, self.load_id, rank),
                lambda name, path: items.load_file(per_file[name], path),
                records=self.records,
                min_sizes=self.min_sizes,
                verify=o.verify_checksums,
                workers=o.download_workers,
                thread_name=f"uc-download-r{rank}",
            )
        tensors = sum(1 for item in plan.items if item.type != LoadItemType.BYTE_IO)
        logger.debug("%d of %d tensor items decoded through templates", items.codec.fast_decoded, tensors)
        self.last_record = stats.record(volume.url, rank)
        logger.info("%s (%s)", self.last_record.describe(), "ranges" if ranged else "whole files")
        fut_done: Future[None] = Future()
        fut_done.set_result(None)
        return fut_done
