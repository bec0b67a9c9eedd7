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
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from uc_checkpoint.dcp import extensions, metadata_io
from uc_checkpoint.dcp.compat import ExtensionRegistry, _StorageInfo
from uc_checkpoint.dcp.items import ChunkShapes, ItemLoader, chunk_shapes
from uc_checkpoint.dcp.sessions import Session, SessionOwner, check_types
from uc_checkpoint.engine.fetch import fetch_files, fetch_ranges
from uc_checkpoint.engine.ranges import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_GAP_BYTES,
    DEFAULT_MAX_RANGE_BYTES,
    MIN_CHUNK_BYTES,
    plan_ranges,
)
from uc_checkpoint.engine.staging_dir import staging_dir_for
from uc_checkpoint.errors import CheckpointNotFoundError, UCCheckpointError
from uc_checkpoint.format import layout
from uc_checkpoint.format.integrity import FileRecord
from uc_checkpoint.observability import TransferRecord
from uc_checkpoint.volumes import Volume

logger = logging.getLogger(__name__)

_MISSING_ATTR = "_uc_missing"


@dataclass
class _LoadSession(Session):
    """One load on one rank (see :mod:`uc_checkpoint.dcp.sessions`): what ``.metadata`` said, for the
    reads that follow."""

    load_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    storage_data: dict[Any, _StorageInfo] = field(default_factory=dict)
    manifest: Mapping[str, Any] | None = None
    records: dict[str, FileRecord] = field(default_factory=dict)
    metadata_error: UCCheckpointError | None = None
    min_sizes: dict[str, int] = field(default_factory=dict)
    chunks: ChunkShapes = field(default_factory=dict)  # what each tensor item holds, for ItemCodec


class UCVolumeReader(SessionOwner, FileSystemReader):  # type: ignore[misc]  # rank: property over attribute
    """DCP storage reader for a checkpoint written to a volume by :class:`UCVolumeWriter` (or by
    DCP's own ``FileSystemWriter`` on a local path).

    Use exactly like DCP's readers::

        dcp.load(state_dict, storage_reader=UCVolumeReader("/mnt/vol/ckpt/step_100"))

    Args:
        path: the checkpoint's location (directory path or URL, or a
            :class:`~uc_checkpoint.volumes.Volume`); ``checkpoint_id=`` replaces it (a URL of the
            same kind as a Volume given here keeps that volume's settings, as for the writer).
        staging_dir: local cache for fetched files (default ``$UC_CHECKPOINT_STAGING_DIR`` or the
            system temp dir); each file is deleted once deserialised.
        download_workers: files (or byte ranges) fetched at once per rank.
        verify_checksums: check every fetched byte against the CRC-32s recorded in the
            checkpoint's manifest: of the whole file, or of each 4 MiB block a ranged read covers
            (checkpoints without a manifest, such as stock ``FileSystemWriter`` ones, are checked for
            size, plus the zip CRC-32 of each tensor item up to 256 KiB).
        prefetch_files: ``True``: download each needed file whole into ``staging_dir``, then read
            it. ``False``: fetch only the byte ranges the load plan needs into memory (ranges of a
            file closer than ``range_gap_bytes`` are merged; big ranges are fetched as parallel
            pieces of ``range_chunk_bytes``, at least 64 KiB). ``None`` (default): ranges on object stores and
            fsspec volumes, whole files on local and FUSE paths.
        max_inflight_bytes: ranged reads hold at most this many fetched bytes in memory before
            they are deserialised (one range larger than this is fetched alone; a range received
            into a reused buffer may occupy up to a quarter more).
        allow_unsafe_metadata: unpickle ``.metadata`` with plain :func:`pickle.loads`. By default
            it may name only the classes DCP's metadata is made of
            (:data:`uc_checkpoint.dcp.metadata_io.ALLOWED_GLOBALS` and torch dtypes). **Risk:** a
            ``.metadata`` pickle can name any function, so with ``True`` whoever could write to the
            checkpoint location can run code in this process. Set it only for checkpoints you trust
            whose metadata holds extra objects (e.g. a custom planner's ``planner_data``).
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

    One reader object may serve several loads at once (each thread's load has its own state,
    :mod:`uc_checkpoint.dcp.sessions`).
    """

    session_type = _LoadSession

    def __init__(
        self,
        path: str | os.PathLike[str] | Volume,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        download_workers: int = 4,
        verify_checksums: bool = True,
        prefetch_files: bool | None = None,
        max_inflight_bytes: int = 256 << 20,
        range_gap_bytes: int = DEFAULT_GAP_BYTES,
        range_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        allow_unsafe_metadata: bool = False,
        volume_options: dict[str, Any] | None = None,
        _extension_registry: ExtensionRegistry | None = None,
    ) -> None:
        registry = extensions.check_registry(_extension_registry)
        sizes = {
            "download_workers": download_workers,
            "max_inflight_bytes": max_inflight_bytes,
            "range_chunk_bytes": range_chunk_bytes,
            "range_gap_bytes": range_gap_bytes,
        }
        check_types(path, sizes)
        if download_workers < 1:
            raise ValueError(f"download_workers must be >= 1, got {download_workers}")
        if max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be >= 1, got {max_inflight_bytes}")
        if range_chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(
                f"range_chunk_bytes must be >= {MIN_CHUNK_BYTES} (64 KiB; each piece is one request), "
                f"got {range_chunk_bytes}"
            )
        if range_gap_bytes < 0:
            raise ValueError(f"range_gap_bytes must be >= 0, got {range_gap_bytes}")
        self._init_sessions(path, volume_options)
        super().__init__(path=".", **({} if registry is None else {"_extension_registry": registry}))
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        #: This rank's :class:`~uc_checkpoint.observability.TransferRecord` of the last load (None before one).
        self.last_record: TransferRecord | None = None
        #: The manifest of the checkpoint this reader last set up a load of (None before one, or for
        #: a checkpoint without one): ``saved_by`` says who saved it (:mod:`uc_checkpoint.format.layout`).
        self.last_manifest: Mapping[str, Any] | None = None
        self.download_workers = download_workers
        self.verify_checksums = verify_checksums
        self.prefetch_files = prefetch_files
        self.max_inflight_bytes = max_inflight_bytes
        self.range_gap_bytes = range_gap_bytes
        self.range_chunk_bytes = range_chunk_bytes
        self.allow_unsafe_metadata = allow_unsafe_metadata

    @property
    def _load(self) -> _LoadSession:
        session = self._session
        assert isinstance(session, _LoadSession)
        return session

    # FileSystemReader keeps these on the object; here they belong to the load (sessions.py).
    @property
    def storage_data(self) -> dict[Any, _StorageInfo]:
        return self._load.storage_data

    @storage_data.setter
    def storage_data(self, value: dict[Any, _StorageInfo]) -> None:
        self._load.storage_data = value

    @property
    def load_id(self) -> str:
        return self._load.load_id

    @load_id.setter
    def load_id(self, value: str) -> None:
        self._load.load_id = value

    @property  # type: ignore[override]
    def path(self) -> None:
        return None  # FileSystemReader's; every read goes through the volume

    @path.setter
    def path(self, value: Any) -> None:
        pass

    def reset(self, checkpoint_id: str | os.PathLike[str] | Volume | None = None) -> None:
        self._reset_location(checkpoint_id)

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
        return metadata_io.read_metadata(self.volume, rank, allow_unsafe=self.allow_unsafe_metadata)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None:  # DCP's first call of a load (a retry for rank-local metadata passes rank)
            self._begin_session()
        try:
            metadata = self.load_metadata(rank)
        except UCCheckpointError as exc:
            if rank is None:
                self._load.metadata_error = exc
                raise
            # DCP retries with rank-local metadata and, when that fails too, replaces our error with
            # a bare AssertionError. Hand it a placeholder so that set_up_storage_reader raises the
            # error of the global .metadata instead.
            placeholder = Metadata(state_dict_metadata={})
            setattr(placeholder, _MISSING_ATTR, True)
            return placeholder
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        load = self._load
        if getattr(metadata, _MISSING_ATTR, False):
            raise load.metadata_error or CheckpointNotFoundError(f"no checkpoint at {self.volume.url}")
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        load.manifest = self.last_manifest = metadata_io.manifest_of(metadata)
        load.records = layout.manifest_records(load.manifest)
        load.min_sizes = metadata_io.referenced_files(metadata)
        load.chunks = chunk_shapes(metadata)

    # ---- data ---------------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch the bytes of ``plan``'s items (ranges or whole files, see ``prefetch_files``) and
        decode each item into ``planner`` as soon as its bytes have arrived and been verified
        (:mod:`uc_checkpoint.engine.fetch`, :mod:`uc_checkpoint.dcp.items`)."""
        volume, load, rank = self.volume, self._load, self._rank()
        stored = (load.storage_data[item.storage_index].transform_descriptors for item in plan.items)
        extensions.check_readable(self.transforms, stored, volume.url)
        ranged = volume.prefers_ranged_reads if self.prefetch_files is None else not self.prefetch_files
        items = ItemLoader(
            volume,
            planner,
            load.storage_data,
            load.chunks,
            transforms=getattr(self, "transforms", None),
            check_archive_crc=not load.records and self.verify_checksums,
        )
        # What each file holds: its recorded size, else the bytes its items need.
        sizes = {**load.min_sizes, **{name: rec.size for name, rec in load.records.items()}}
        if ranged:
            # Only the byte ranges the plan needs, widened to checksum blocks when verifying.
            records = load.records if self.verify_checksums else {}
            requests = plan_ranges(
                items.spans(plan.items),
                file_sizes=sizes,
                block_sizes={name: rec.block_size for name, rec in records.items()},
                gap_bytes=self.range_gap_bytes,
                max_range_bytes=max(DEFAULT_MAX_RANGE_BYTES, self.range_chunk_bytes),
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
                chunk_bytes=self.range_chunk_bytes,
                max_inflight_bytes=self.max_inflight_bytes,
                workers=self.download_workers,
                thread_name=f"uc-range-r{rank}",
            )
        else:
            by_file = items.by_file(plan.items).items()  # largest first, as above
            per_file = dict(sorted(by_file, key=lambda kv: sizes.get(kv[0], 0), reverse=True))
            stats = fetch_files(
                volume,
                per_file,
                staging_dir_for(self.staging_dir, "load", volume.url, load.load_id, rank),
                lambda name, path: items.load_file(per_file[name], path),
                records=load.records,
                min_sizes=load.min_sizes,
                verify=self.verify_checksums,
                workers=self.download_workers,
                thread_name=f"uc-download-r{rank}",
            )
        tensors = sum(1 for item in plan.items if item.type != LoadItemType.BYTE_IO)
        logger.debug("%d of %d tensor items decoded through templates", items.codec.fast_decoded, tensors)
        self.last_record = stats.record(volume.url, rank)
        logger.info("%s (%s)", self.last_record.describe(), "ranges" if ranged else "whole files")
        fut_done: Future[None] = Future()
        fut_done.set_result(None)
        return fut_done
