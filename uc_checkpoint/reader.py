"""``UCVolumeReader``: a DCP storage reader that fetches only the files a load needs, in parallel,
into a local staging cache, and deserialises each file as soon as it has arrived and been verified.

Items are deserialised as DCP's ``FileSystemReader`` does (``torch.load`` of each tensor item, then
copied into the load plan's tensor), except that small tensor items written by our writer (or by
``torch.save`` of a plain tensor) are decoded by :class:`~uc_checkpoint.item_codec.ItemCodec`.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import threading
import time
import uuid
import zipfile
from collections.abc import Mapping
from concurrent.futures import as_completed
from dataclasses import dataclass, field
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from . import layout, metadata_io
from .dcp_compat import _StorageInfo, narrow_tensor_by_index
from .errors import CheckpointNotFoundError, CorruptCheckpointError, TransferError, UCCheckpointError
from .integrity import FileRecord, verify_blocks
from .item_codec import ItemChecksumError, ItemCodec
from .ranges import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_GAP_BYTES,
    DEFAULT_MAX_RANGE_BYTES,
    ByteBudget,
    RangeRequest,
    plan_ranges,
)
from .records import TransferRecord
from .sessions import Session, SessionOwner
from .staging import create_staging_dir, remove_staging_dir, staging_dir_for
from .transfer import TransferPool
from .volumes import Volume

logger = logging.getLogger(__name__)

_MISSING_ATTR = "_uc_missing"


@dataclass
class _LoadSession(Session):
    """One load on one rank (see :mod:`uc_checkpoint.sessions`): what ``.metadata`` said, for the
    reads that follow."""

    load_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    storage_data: dict[Any, _StorageInfo] = field(default_factory=dict)
    manifest: Mapping[str, Any] | None = None
    records: dict[str, FileRecord] = field(default_factory=dict)
    metadata_error: UCCheckpointError | None = None
    min_sizes: dict[str, int] = field(default_factory=dict)
    # (fqn, chunk offsets) -> (dtype, chunk shape): what each tensor item holds, for ItemCodec.
    chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)


class UCVolumeReader(SessionOwner, FileSystemReader):  # type: ignore[misc]  # rank: property over attribute
    """DCP storage reader for a checkpoint written to a volume by :class:`UCVolumeWriter` (or by
    DCP's own ``FileSystemWriter`` on a local path).

    Use exactly like DCP's readers::

        dcp.load(state_dict, storage_reader=UCVolumeReader("/mnt/vol/ckpt/step_100"))

    Args:
        path: the checkpoint's location (directory path or URL, or a
            :class:`~uc_checkpoint.volumes.Volume`); ``checkpoint_id=`` replaces it.
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
            pieces of ``range_chunk_bytes``). ``None`` (default): ranges on object stores and
            fsspec volumes, whole files on local and FUSE paths.
        max_inflight_bytes: ranged reads hold at most this many fetched bytes in memory before
            they are deserialised (one range larger than this is fetched alone).
        allow_unsafe_metadata: unpickle ``.metadata`` with plain :func:`pickle.loads`. By default
            it may name only the classes DCP's metadata is made of
            (:data:`uc_checkpoint.metadata_io.ALLOWED_GLOBALS` and torch dtypes). **Risk:** a
            ``.metadata`` pickle can name any function, so with ``True`` whoever could write to the
            checkpoint location can run code in this process. Set it only for checkpoints you trust
            whose metadata holds extra objects (e.g. a custom planner's ``planner_data``).
        volume_options: options for the volume of a path or URL (see
            :func:`uc_checkpoint.volumes.open_volume`).

    Raises (inside DCP's ``CheckpointException``):
        VolumeError: the location is a file, or its bucket does not exist.
        CheckpointNotFoundError: no ``.metadata`` at the location.
        CorruptCheckpointError: ``.metadata`` cannot be read or names a data file outside the
            checkpoint, or a data file is missing, truncated or fails its checksum. The message
            names the file.
        UnsafeMetadataError: (a ``CorruptCheckpointError``) ``.metadata`` names a global that is not
            part of DCP's metadata format; the message names it.

    One reader object may serve several loads at once (each thread's load has its own state,
    :mod:`uc_checkpoint.sessions`).
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
    ) -> None:
        if not isinstance(path, (str, os.PathLike, Volume)):
            raise TypeError(f"path must be a path, URL or Volume, got {type(path).__name__}")
        if download_workers < 1:
            raise ValueError(f"download_workers must be >= 1, got {download_workers}")
        for arg, value in (("max_inflight_bytes", max_inflight_bytes), ("range_chunk_bytes", range_chunk_bytes)):
            if value < 1:
                raise ValueError(f"{arg} must be >= 1, got {value}")
        if range_gap_bytes < 0:
            raise ValueError(f"range_gap_bytes must be >= 0, got {range_gap_bytes}")
        self._init_sessions(path, volume_options)
        super().__init__(path=".")
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        #: This rank's :class:`~uc_checkpoint.records.TransferRecord` of the last load (None before one).
        self.last_record: TransferRecord | None = None
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

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reset_location(checkpoint_id)

    # ---- metadata -----------------------------------------------------------------------------
    def load_metadata(self, rank: int | None = None) -> Metadata:
        """Fetch, decode and check ``.metadata`` (or ``__<rank>.metadata``), see
        :func:`uc_checkpoint.metadata_io.load_metadata`.

        Raises:
            CheckpointNotFoundError: the file does not exist.
            UnsafeMetadataError: it names a global outside the allow-list (and
                ``allow_unsafe_metadata`` is False).
            CorruptCheckpointError: it exists but is not a DCP ``Metadata`` pickle, or it names a
                data file outside the checkpoint location.
        """
        volume = self.volume
        name = layout.metadata_name(rank)
        data = volume.read_bytes(name)
        if data is None:
            raise CheckpointNotFoundError(
                f"no checkpoint at {volume.url}: {volume.describe(name)} does not exist "
                "(never saved, or the save did not finish)"
            )
        return metadata_io.load_metadata(data, volume.describe(name), allow_unsafe=self.allow_unsafe_metadata)

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
        load.manifest = layout.manifest_of(metadata)
        load.records = layout.manifest_records(load.manifest)
        load.min_sizes = layout.referenced_files(metadata)
        load.chunks = {
            (fqn, tuple(chunk.offsets)): (md.properties.dtype, tuple(chunk.sizes))
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }

    # ---- data ---------------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        volume = self.volume
        rank = self._rank()
        ranged = volume.prefers_ranged_reads if self.prefetch_files is None else not self.prefetch_files
        started = time.perf_counter()
        retries_before = volume.retries
        codec = ItemCodec()
        if ranged:
            nfiles, nbytes = self._read_ranges(volume, plan, planner, rank, codec)
        else:
            nfiles, nbytes = self._read_files(volume, plan, planner, rank, codec)
        logger.debug(
            "%d of %d tensor items decoded through templates",
            codec.fast_decoded,
            sum(1 for item in plan.items if item.type != LoadItemType.BYTE_IO),
        )
        elapsed = time.perf_counter() - started
        # Reads and deserialisation overlap: the transfer time is the whole read step.
        self.last_record = TransferRecord(
            op="load",
            location=volume.url,
            rank=rank,
            bytes=nbytes,
            files=nfiles,
            total_s=elapsed,
            staging_s=0.0,
            transfer_s=elapsed,
            retries=volume.retries - retries_before,
        )
        logger.info("%s (%s)", self.last_record.describe(), "ranges" if ranged else "whole files")
        fut_done: Future[None] = Future()
        fut_done.set_result(None)
        return fut_done

    def _read_files(
        self, volume: Volume, plan: LoadPlan, planner: LoadPlanner, rank: int, codec: ItemCodec
    ) -> tuple[int, int]:
        """Download each needed file whole into staging, verify it, deserialise it; files are
        fetched in parallel and each is deserialised as soon as it has arrived."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        cache = create_staging_dir(staging_dir_for(self.staging_dir, "load", volume.url, self.load_id, rank))
        nbytes = 0
        load = self._load  # fetch runs in pool threads, which have no session of their own

        def fetch(name: str) -> FileRecord:
            # Sizes are checked before a byte is read, and nothing past them is read.
            expected = load.records.get(name)
            record = volume.download_file(
                name,
                cache / name,
                expected_size=None if expected is None else expected.size,
                min_size=load.min_sizes.get(name, 0),
            )
            self._verify_file(volume, record, load)
            return record

        pool = TransferPool(self.download_workers, name=f"uc-download-r{rank}")
        try:
            futures = {pool.submit(fetch, name): name for name in per_file}
            for fut in as_completed(futures):
                name = futures[fut]
                nbytes += fut.result().size
                with open(cache / name, "rb") as f:
                    for item in per_file[name]:
                        info = self.storage_data[item.storage_index]
                        f.seek(info.offset)
                        self._load_item(volume, item, info, memoryview(f.read(info.length)), planner, codec)
                (cache / name).unlink(missing_ok=True)
        finally:
            pool.shutdown(cancel_pending=True)
            volume.close()  # its transfer threads end here; the next use makes new ones
            remove_staging_dir(cache)
        return len(per_file), nbytes

    def _read_ranges(
        self, volume: Volume, plan: LoadPlan, planner: LoadPlanner, rank: int, codec: ItemCodec
    ) -> tuple[int, int]:
        """Fetch only the byte ranges the plan needs, in parallel pieces, with at most
        ``max_inflight_bytes`` fetched ahead of deserialisation; verify each range's checksum
        blocks; deserialise each range as soon as it is complete."""
        spans = []
        for item in plan.items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            spans.append((info.relative_path, info.offset, info.length, item))
        records = self._load.records
        sizes = {name: rec.size for name, rec in records.items()}
        blocks = {name: rec.block_size for name, rec in records.items()} if self.verify_checksums else {}
        requests = plan_ranges(
            spans,
            file_sizes={**self._load.min_sizes, **sizes},
            block_sizes=blocks,
            gap_bytes=self.range_gap_bytes,
            max_range_bytes=max(DEFAULT_MAX_RANGE_BYTES, self.range_chunk_bytes),
        )
        done: queue.Queue[tuple[RangeRequest[ReadItem], bytearray | None, BaseException | None]] = queue.Queue()
        budget = ByteBudget(self.max_inflight_bytes)
        pool = TransferPool(self.download_workers, name=f"uc-range-r{rank}")
        nbytes = 0

        def start(req: RangeRequest[ReadItem]) -> None:
            buf = bytearray(req.nbytes)
            pieces = req.pieces(self.range_chunk_bytes)
            remaining = [len(pieces)]
            failed: list[BaseException] = []
            lock = threading.Lock()

            def fetch(lo: int, hi: int) -> None:
                try:
                    if not failed:
                        buf[lo - req.start : hi - req.start] = volume.read_range(req.name, lo, hi)
                except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
                    failed.append(exc)
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    done.put((req, None if failed else buf, failed[0] if failed else None))

            for lo, hi in pieces:
                pool.submit(fetch, lo, hi)

        def consume() -> None:
            nonlocal nbytes
            req, buf, exc = done.get()
            if exc is not None:
                if isinstance(exc, UCCheckpointError):
                    raise exc
                raise TransferError(f"reading {volume.describe(req.name)} failed: {exc}") from exc
            assert buf is not None
            self._deserialise_range(volume, req, memoryview(buf), planner, codec)
            nbytes += req.nbytes
            budget.give(req.nbytes)

        outstanding = 0
        try:
            for req in requests:
                while not budget.try_take(req.nbytes):
                    consume()
                    outstanding -= 1
                start(req)
                outstanding += 1
            while outstanding:
                consume()
                outstanding -= 1
        finally:
            pool.shutdown(cancel_pending=True)
            volume.close()  # its transfer threads end here; the next use makes new ones
        return len({r.name for r in requests}), nbytes

    def _deserialise_range(
        self, volume: Volume, req: RangeRequest[ReadItem], data: memoryview, planner: LoadPlanner, codec: ItemCodec
    ) -> None:
        record = self._load.records.get(req.name)
        if record is not None and self.verify_checksums:
            verify_blocks(data, req.start, record, volume.describe(req.name))
        for item in req.items:
            info = self.storage_data[item.storage_index]
            lo = info.offset - req.start
            self._load_item(volume, item, info, data[lo : lo + info.length], planner, codec)

    def _load_item(
        self,
        volume: Volume,
        req: ReadItem,
        info: _StorageInfo,
        data: memoryview,
        planner: LoadPlanner,
        codec: ItemCodec,
    ) -> None:
        """Deserialise one item from its bytes and hand it to the planner, as DCP's
        ``FileSystemReader.read_data`` does for each item."""
        if info.transform_descriptors:  # written with DCP extensions (e.g. compression)
            stream = self.transforms.transform_load_stream(req, info.transform_descriptors, io.BytesIO(data))
            data = memoryview(stream.read(-1))
        where = f"{volume.describe(info.relative_path)}: item {req.storage_index.fqn} at offset {info.offset}"
        if req.type == LoadItemType.BYTE_IO:
            try:
                planner.load_bytes(req, io.BytesIO(data))
            except UCCheckpointError:
                raise
            except Exception as exc:  # torch.load of bytes that are not the item (damaged metadata or file)
                raise CorruptCheckpointError(f"{where} cannot be decoded: {type(exc).__name__}: {exc}") from exc
            return
        saved = self._load.chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        try:
            tensor = codec.decode(data, *saved) if saved is not None else None
        except ItemChecksumError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}") from exc
        if tensor is None and not self._load.records and self.verify_checksums:
            # No manifest (a stock checkpoint): nothing else covers these bytes, and torch.load does
            # not check the archive's own CRC-32s.
            bad = _zip_crc_problem(data)
            if bad is not None:
                raise CorruptCheckpointError(f"{where} fails its archive's CRC-32 ({bad}): the file was damaged")
        try:
            if tensor is None:
                tensor = torch.load(cast(IO[bytes], _MemoryReader(data)), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        except Exception as exc:  # not a tensor archive, or not the chunk the metadata describes
            raise CorruptCheckpointError(f"{where} cannot be decoded: {type(exc).__name__}: {exc}") from exc
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{volume.describe(info.relative_path)}: item {req.storage_index.fqn} gives a tensor of shape "
                f"{tuple(tensor.size())}, the load plan expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def _verify_file(self, volume: Volume, record: FileRecord, load: _LoadSession) -> None:
        # Sizes were checked by download_file before a byte was copied; the content is checked here.
        expected = load.records.get(record.name)
        if expected is not None and self.verify_checksums and record.crc32 != expected.crc32:
            raise CorruptCheckpointError(
                f"{volume.describe(record.name)} fails its checksum: crc32 {record.crc32}, recorded {expected.crc32}"
            )


def _zip_crc_problem(data: memoryview) -> str | None:
    """The first member of the zip archive ``data`` whose CRC-32 is wrong (or why it is no zip),
    else None. Reads every member once, without copying ``data``."""
    try:
        with zipfile.ZipFile(cast(IO[bytes], _MemoryReader(data))) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if bad is None else f"member {bad}"


class _MemoryReader(io.RawIOBase):
    """A read-only, seekable stream over a memoryview, without copying it (``io.BytesIO`` would)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        chunk = self._data[self._pos : self._pos + len(b)]
        n = len(chunk)
        memoryview(b).cast("B")[:n] = chunk
        self._pos += n
        return n
