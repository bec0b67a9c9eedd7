"""``UCVolumeReader``: a DCP storage reader that fetches only the files a load needs, in parallel,
into a local staging cache, and deserialises each file as soon as it has arrived and been verified.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from collections.abc import Mapping
from concurrent.futures import as_completed
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from . import layout
from .errors import CheckpointNotFoundError, CorruptCheckpointError, UCCheckpointError, VolumeError
from .staging import create_staging_dir, remove_staging_dir, staging_dir_for
from .transfer import TransferPool
from .volumes import FileRecord, Volume, open_volume

logger = logging.getLogger(__name__)

_MISSING_ATTR = "_uc_missing"


class UCVolumeReader(FileSystemReader):
    """DCP storage reader for a checkpoint written to a volume by :class:`UCVolumeWriter` (or by
    DCP's own ``FileSystemWriter`` on a local path).

    Use exactly like DCP's readers::

        dcp.load(state_dict, storage_reader=UCVolumeReader("/mnt/vol/ckpt/step_100"))

    Args:
        path: the checkpoint's location (directory path or URL, or a
            :class:`~uc_checkpoint.volumes.Volume`); ``checkpoint_id=`` replaces it.
        staging_dir: local cache for fetched files (default ``$UC_CHECKPOINT_STAGING_DIR`` or the
            system temp dir); each file is deleted once deserialised.
        download_workers: files fetched at once per rank.
        verify_checksums: check every fetched file against the size and CRC-32 recorded in the
            checkpoint's manifest (checkpoints without one are checked for size only).

    Raises (inside DCP's ``CheckpointException``):
        CheckpointNotFoundError: no ``.metadata`` at the location.
        CorruptCheckpointError: ``.metadata`` cannot be read, or a data file is missing, truncated
            or fails its checksum. The message names the file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Volume,
        *,
        staging_dir: str | os.PathLike[str] | None = None,
        download_workers: int = 4,
        verify_checksums: bool = True,
    ) -> None:
        if download_workers < 1:
            raise ValueError(f"download_workers must be >= 1, got {download_workers}")
        super().__init__(path=".")
        self.path = None  # type: ignore[assignment]  # the cache dir, set per load in read_data
        self._location: str | Volume = path if isinstance(path, Volume) else os.fspath(path)
        self.staging_dir = None if staging_dir is None else os.fspath(staging_dir)
        self.download_workers = download_workers
        self.verify_checksums = verify_checksums
        self._manifest: Mapping[str, Any] | None = None
        self._metadata_error: UCCheckpointError | None = None
        self._min_sizes: dict[str, int] = {}

    @property
    def volume(self) -> Volume:
        """The checkpoint's location as a :class:`Volume` (created on use)."""
        return open_volume(self._location)

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.volume.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            open_volume(checkpoint_id)
        except VolumeError:
            return False
        return True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(None)
        if checkpoint_id:
            self._location = os.fspath(checkpoint_id)
        self._manifest = None
        self._metadata_error = None

    # ---- metadata -----------------------------------------------------------------------------
    def load_metadata(self, rank: int | None = None) -> Metadata:
        """Fetch and decode ``.metadata`` (or ``__<rank>.metadata``).

        Raises:
            CheckpointNotFoundError: the file does not exist.
            CorruptCheckpointError: it exists but is not a DCP ``Metadata`` pickle.
        """
        volume = self.volume
        name = layout.metadata_name(rank)
        data = volume.read_bytes(name)
        if data is None:
            raise CheckpointNotFoundError(
                f"no checkpoint at {volume.url}: {volume.describe(name)} does not exist "
                "(never saved, or the save did not finish)"
            )
        try:
            metadata = pickle.loads(data)
        except Exception as exc:
            raise CorruptCheckpointError(f"{volume.describe(name)} is corrupt or truncated: {exc}") from exc
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(
                f"{volume.describe(name)} does not hold DCP Metadata (found {type(metadata).__name__})"
            )
        _check_file_names(metadata, volume)
        return metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        try:
            metadata = self.load_metadata(rank)
        except UCCheckpointError as exc:
            if rank is None:
                self._metadata_error = exc
                raise
            if not isinstance(exc, CheckpointNotFoundError):
                raise
            # DCP retries with rank-local metadata and, when that is missing too, replaces our error
            # with a bare AssertionError. Hand it a placeholder so that set_up_storage_reader raises
            # the error of the global .metadata instead.
            placeholder = Metadata(state_dict_metadata={})
            setattr(placeholder, _MISSING_ATTR, True)
            return placeholder
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if getattr(metadata, _MISSING_ATTR, False):
            raise self._metadata_error or CheckpointNotFoundError(f"no checkpoint at {self.volume.url}")
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._manifest = layout.manifest_of(metadata)
        self._min_sizes = layout.referenced_files(metadata)

    # ---- data ---------------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        volume = self.volume
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        rank = self.rank if self.rank is not None else 0
        cache = create_staging_dir(staging_dir_for(self.staging_dir, "load", volume.url, self.load_id, rank))
        self.path = cache  # type: ignore[assignment]  # FileSystemReader reads fetched files here
        started = time.perf_counter()
        nbytes = 0

        def fetch(name: str) -> FileRecord:
            record = volume.download_file(name, cache / name)
            self._verify(volume, record, self._min_sizes.get(name, 0))
            return record

        pool = TransferPool(self.download_workers, name=f"uc-download-r{rank}")
        try:
            futures = {pool.submit(fetch, name): name for name in per_file}
            for fut in as_completed(futures):
                name = futures[fut]
                record = fut.result()
                nbytes += record.size
                # Deserialise this file while the others are still being fetched.
                super().read_data(dataclasses.replace(plan, items=per_file[name]), planner).wait()
                (cache / name).unlink(missing_ok=True)
        finally:
            pool.shutdown(cancel_pending=True)
            remove_staging_dir(cache)
        elapsed = time.perf_counter() - started
        logger.info(
            "rank %d: %d files, %d bytes from %s in %.3f s (%.1f MB/s)",
            rank, len(per_file), nbytes, volume.url, elapsed, nbytes / max(elapsed, 1e-9) / 1e6,
        )
        fut_done: Future[None] = Future()
        fut_done.set_result(None)
        return fut_done

    def _verify(self, volume: Volume, record: FileRecord, min_size: int) -> None:
        where = volume.describe(record.name)
        expected = (self._manifest or {}).get("files", {}).get(record.name)
        if expected is not None:
            if record.size != expected["size"]:
                raise CorruptCheckpointError(
                    f"{where} has {record.size} bytes, the checkpoint recorded {expected['size']} (truncated or replaced)"
                )
            if self.verify_checksums and record.crc32 != expected["crc32"]:
                raise CorruptCheckpointError(
                    f"{where} fails its checksum: crc32 {record.crc32}, recorded {expected['crc32']}"
                )
        elif record.size < min_size:
            raise CorruptCheckpointError(f"{where} has {record.size} bytes, the checkpoint needs at least {min_size}")


def _check_file_names(metadata: Metadata, volume: Volume) -> None:
    """Reject metadata whose data file names would leave the checkpoint location."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise CorruptCheckpointError(
                f"{volume.describe(layout.METADATA_NAME)} names data file {name!r} outside the checkpoint"
            )

