"""A rank's share of a save as data files in DCP's own format, written into local staging.

The format is what ``FileSystemWriter`` writes with ``SerializationFormat.TORCH_SAVE`` (one
``torch.save`` archive per tensor, pickled bytes as they are), so stock DCP readers load our
checkpoints; small tensors go through :class:`~uc_checkpoint.dcp.item_codec.ItemCodec`, which writes
the same archives without pickling each item. The file loop follows DCP's ``_write_files_from_queue``
(``torch/distributed/checkpoint/filesystem.py``), with two changes: each file is reported the
moment it is closed (so its upload starts while the next one is written), and a rank's files are
sized from its own chunks, not the global tensors.

Also here: the ``_StorageInfo`` that carries each file's upload record from a rank's
``write_data`` to the coordinator's ``finish``, and the pieces of ``.metadata`` the writer fills in.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from uc_checkpoint.dcp import extensions
from uc_checkpoint.dcp.compat import (
    CURRENT_DCP_VERSION,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
    cpu_loader,
)
from uc_checkpoint.dcp.item_codec import ItemCodec
from uc_checkpoint.dcp.planner import is_small, item_bytes
from uc_checkpoint.errors import TransferError
from uc_checkpoint.format import layout
from uc_checkpoint.volumes import FileRecord

logger = logging.getLogger(__name__)

#: The automatic data-file size (``file_size_bytes=None``): a rank's share of the checkpoint is cut
#: into about this many files, so the first upload starts early and the last one is short, but the
#: files stay between the two bounds (bytes) to keep request and object counts sane
#: (docs/benchmarks-design.md, "Data file size").
AUTO_FILES_PER_RANK = 16
MIN_AUTO_FILE_SIZE = 16 << 20
MAX_AUTO_FILE_SIZE = 256 << 20

#: One data file to write: its staging path, its name (DCP's storage key) and its write items.
FileJob = tuple[Path, str, list[Any]]


def auto_file_size(rank_bytes: int) -> int:
    """Target size in bytes of one data file for a rank saving ``rank_bytes`` bytes: about
    ``rank_bytes / AUTO_FILES_PER_RANK``, clamped to [16 MiB, 256 MiB]."""
    return min(MAX_AUTO_FILE_SIZE, max(MIN_AUTO_FILE_SIZE, -(-rank_bytes // AUTO_FILES_PER_RANK)))


class StagingFileSystem(FileSystem):
    """DCP's local filesystem that calls ``on_file_written(path)`` for every file it finishes
    writing (in the thread that closed it)."""

    def __init__(self, on_file_written: Callable[[Path], object]) -> None:
        super().__init__()
        self._on_file_written = on_file_written

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            yield stream
        if "w" in mode:
            self._on_file_written(Path(path))


@dataclass
class UploadedStorageInfo(_StorageInfo):
    """``_StorageInfo`` plus what the upload recorded for the whole file; it travels from each
    rank's ``write_data`` to the coordinator's ``finish`` and is turned back into a plain
    ``_StorageInfo`` before ``.metadata`` is written, so stock readers can load the checkpoint."""

    record: FileRecord | None = None

    def plain(self) -> _StorageInfo:
        return _StorageInfo(self.relative_path, self.offset, self.length, self.transform_descriptors)


def _write_result(item: Any, storage_key: str, offset: int, length: int) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, offset, length))


def with_file_prefix(plan: SavePlan, rank: int, token: str, spread_prefixes: int = 1) -> SavePlan:
    """``plan`` naming its data files ``__<rank>_<token>_<n>.distcp``, or
    ``<spread>/__<rank>_<token>_<n>.distcp`` when the save spreads them over ``spread_prefixes``
    key prefixes (see :mod:`uc_checkpoint.format.layout`)."""
    prefix = layout.data_file_prefix(rank, token, layout.spread_dir(rank, spread_prefixes))
    return dataclasses.replace(plan, storage_data=_StoragePrefix(prefix))


def file_queue(
    plan: SavePlan,
    staging: Path,
    *,
    file_size_bytes: int | None,
    threads: int,
    single_file_per_rank: bool | None = None,
) -> queue.Queue[FileJob]:
    """Cut a rank's plan (its ``storage_data`` a ``_StoragePrefix``) into data files in ``staging``
    (in a sub-directory of it, named as the spread prefix, when the prefix has one). When the rank
    has both small items (:func:`~uc_checkpoint.dcp.planner.is_small`) and large ones, its small
    items get one file of their own, the first, even where the whole share would fit in one file;
    the large items are balanced over the others as DCP does.

    Args:
        file_size_bytes: target bytes per file; None: :func:`auto_file_size` of the rank's share.
        threads: at least this many files of large items (or of all items, where the rank has
            only small or only large ones), so every serialising thread has one to work on.
        single_file_per_rank: as DCP's ``FileSystemWriter``: True, the rank's items split over
            ``threads`` files (one when ``threads`` is 1) as DCP splits them; False, one file per
            item; None (default), files sized as above.
    """
    prefix = plan.storage_data.prefix
    small = [item for item in plan.items if is_small(item)]
    large = [item for item in plan.items if not is_small(item)]
    total = sum(item_bytes(item) for item in plan.items if item.type != WriteItemType.BYTE_IO)
    size = file_size_bytes if file_size_bytes is not None else auto_file_size(total)
    jobs: queue.Queue[FileJob] = queue.Queue()
    if single_file_per_rank is not None:
        items = list(plan.items)
        split = _split_by_size_and_type(threads, items) if single_file_per_rank else [[item] for item in items]
        buckets = [b for b in split if b]
    elif small and large:
        # A rank's small items in a small file of their own, first: every rank reads the step and
        # the replicated scalars back, and one GET of a file smaller than a checksum block does
        # (scattered over the large files, each read widened to a 4 MiB block; dcp/planner.py).
        # Even where the share fits in one file: inside it, every other rank's load fetched whole
        # blocks of rank 0's big file for a few scalars (docs/benchmarks-design.md, "Small items").
        n_large = max(threads, math.ceil(sum(item_bytes(item) for item in large) / size), 1)
        buckets = [small, *(b for b in _split_by_size_and_type(n_large, large) if b)]
    else:
        n_files = max(threads, math.ceil(total / size), 1)
        buckets = [b for b in _split_by_size_and_type(n_files, list(plan.items)) if b]
    if "/" in prefix:  # a spread prefix: staged under the same relative path as on the volume
        (staging / prefix).parent.mkdir(exist_ok=True)
    for n, bucket in enumerate(buckets):
        name = f"{prefix}{n}{DEFAULT_SUFFIX}"
        jobs.put((staging / name, name, bucket))
    return jobs


def write_files(
    jobs: queue.Queue[FileJob],
    planner: SavePlanner,
    *,
    threads: int,
    copy_ahead: int,
    on_closed: Callable[[Path], object],
    transforms: Any | None = None,
) -> list[WriteResult]:
    """Write every queued data file on ``threads`` threads (the caller's among them);
    ``on_closed(path)`` is called for each as soon as it is closed.

    Args:
        copy_ahead: bytes of accelerator tensors each thread copies to the CPU ahead of writing
            (DCP's ``per_thread_copy_ahead``; 0 for a snapshot already on the CPU).
        transforms: DCP's writer transforms with stream extensions to write every item through
            (:func:`uc_checkpoint.dcp.extensions.write_item`), or None for plain items.

    Returns one ``WriteResult`` per item (``storage_data`` a plain ``_StorageInfo``), in no set order.

    Raises:
        the first error of any thread (the others stop after their current file).
    """
    fs = StagingFileSystem(on_closed)
    codec = ItemCodec()
    results: list[WriteResult] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        try:
            while not errors:
                try:
                    path, storage_key, items = jobs.get_nowait()
                except queue.Empty:
                    return
                written = _write_file(path, storage_key, items, planner, codec, fs, threads, copy_ahead, transforms)
                with lock:
                    results.extend(written)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)

    helpers = [threading.Thread(target=work, name=f"uc-serialise-{i}", daemon=True) for i in range(1, threads)]
    for t in helpers:
        t.start()
    work()
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]
    logger.debug("%d of %d tensor items serialised through templates", codec.fast_encoded, codec.encoded)
    return results


def _write_file(
    path: Path,
    storage_key: str,
    items: list[Any],
    planner: SavePlanner,
    codec: ItemCodec,
    fs: StagingFileSystem,
    threads: int,
    copy_ahead: int,
    transforms: Any | None,
) -> list[WriteResult]:
    # As DCP's writer: accelerator tensors of a synchronous save are copied to the CPU a little
    # ahead of serialisation (async saves arrive here already on the CPU).
    loader = cpu_loader(planner.resolve_data, threads, copy_ahead)
    for item in items:
        if item.type != WriteItemType.BYTE_IO:
            loader.add(item_bytes(item), item)
    loader.start_loading()
    out: list[WriteResult] = []
    if transforms is not None:
        return _write_transformed_file(path, storage_key, items, planner, codec, fs, loader, transforms)
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


def _write_transformed_file(
    path: Path,
    storage_key: str,
    items: list[Any],
    planner: SavePlanner,
    codec: ItemCodec,
    fs: StagingFileSystem,
    loader: Any,
    transforms: Any,
) -> list[WriteResult]:
    """:func:`_write_file` with every item written through DCP's stream extensions, in the same
    order (byte items first, then tensors as the loader yields them)."""
    out: list[WriteResult] = []
    with fs.create_stream(path, "wb") as stream:
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                data = cast(io.BytesIO, planner.resolve_data(item)).getbuffer()
                out.append(extensions.write_item(transforms, stream, item, storage_key, data, codec))
        for tensor, item in loader.values():
            out.append(extensions.write_item(transforms, stream, item, storage_key, tensor, codec))
    return out


def attach_records(
    results: Iterable[WriteResult], records: dict[str, FileRecord], describe: Callable[[str], str]
) -> list[WriteResult]:
    """``results`` with each file's upload record attached (:class:`UploadedStorageInfo`).

    Raises:
        TransferError: a file was written but has no record (a bug, not an I/O fault: never
            publish over it); ``describe(name)`` names it in the message.
    """
    out: list[WriteResult] = []
    for wr in results:
        info: _StorageInfo = wr.storage_data
        record = records.get(info.relative_path)
        if record is None:
            raise TransferError(f"{describe(info.relative_path)} was written but never uploaded")
        uploaded = UploadedStorageInfo(info.relative_path, info.offset, info.length, info.transform_descriptors, record)
        out.append(dataclasses.replace(wr, storage_data=uploaded))
    return out


def split_results(results: list[list[WriteResult]]) -> tuple[dict[Any, _StorageInfo], dict[str, FileRecord]]:
    """Every rank's results as ``.metadata``'s ``storage_data`` (plain ``_StorageInfo``, which
    stock readers know) and the upload records by file name."""
    records: dict[str, FileRecord] = {}
    storage_md: dict[Any, _StorageInfo] = {}
    for rank_results in results:
        for wr in rank_results:
            info = wr.storage_data
            if isinstance(info, UploadedStorageInfo):
                if info.record is not None:
                    records[info.relative_path] = info.record
                info = info.plain()
            storage_md[wr.index] = info
    return storage_md, records


def complete_metadata(
    metadata: Metadata,
    storage_md: dict[Any, _StorageInfo],
    storage_meta: StorageMeta | None,
    save_id: str,
    records: Iterable[FileRecord],
    mlflow_run_id: str | None = None,
) -> None:
    """Fill in what the storage layer owns in DCP's ``metadata``: the format version, where each
    item is stored, ``storage_meta``, and our manifest of the data files ``records`` (see
    :mod:`uc_checkpoint.format.layout`), signed with this process's host, pid and the time (and
    ``mlflow_run_id``, the MLflow run of the save, when given)."""
    saved_by: dict[str, object] = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    if mlflow_run_id is not None:
        saved_by["mlflow_run_id"] = mlflow_run_id
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = storage_md
    metadata.storage_meta = storage_meta
    setattr(metadata, layout.MANIFEST_ATTR, layout.build_manifest(save_id, records, saved_by))


__all__ = [
    "AUTO_FILES_PER_RANK",
    "MAX_AUTO_FILE_SIZE",
    "MIN_AUTO_FILE_SIZE",
    "StagingFileSystem",
    "UploadedStorageInfo",
    "attach_records",
    "auto_file_size",
    "complete_metadata",
    "file_queue",
    "split_results",
    "with_file_prefix",
    "write_files",
]
