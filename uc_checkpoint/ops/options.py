"""Typed settings for the writer and reader a :class:`~uc_checkpoint.ops.manager.CheckpointManager` creates.

``CheckpointManager(writer_options=..., reader_options=...)`` takes a :class:`WriterOptions` /
:class:`ReaderOptions` or a plain dict of the same fields (converted with ``from_dict``). Either way
the settings are checked once, when the manager is built, rather than at the first save or load
(settings kept apart from the engine and validated in one loop, after s3transfer's
``TransferConfig``). Each field is the keyword argument of the same name of
:class:`~uc_checkpoint.dcp.writer.UCVolumeWriter` / :class:`~uc_checkpoint.dcp.reader.UCVolumeReader`, with
the same default.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

from uc_checkpoint.engine.ranges import DEFAULT_CHUNK_BYTES, DEFAULT_GAP_BYTES, MIN_CHUNK_BYTES
from uc_checkpoint.format.layout import MAX_SPREAD_PREFIXES
from uc_checkpoint.volumes import Volume

logger = logging.getLogger(__name__)

_OptionsT = TypeVar("_OptionsT", bound="_Options")

# Keys of the writer's and reader's constructors that the manager sets itself, and where they go.
_MANAGER_OWNED = {
    "path": "the manager passes each checkpoint's location",
    "staging_dir": "pass CheckpointManager(staging_dir=...)",
    "volume_options": "pass CheckpointManager(volume_options=...): every checkpoint under the root gets them",
    "staging_buffers": "pass CheckpointManager(reuse_staging_buffers=True): the manager keeps one set for its saves",
    "mlflow_run_id": "the manager records the MLflow run it logs to (uc_checkpoint.observability)",
}


@dataclass(frozen=True)
class _Options(Mapping[str, Any]):
    """Frozen settings that also read as a mapping of their fields (``**options``, ``dict(options)``,
    ``options["name"]``), as the dicts the manager took before did."""

    #: field -> (accepted types, smallest value or None). bool is never taken for an int.
    _RULES: ClassVar[dict[str, tuple[tuple[type, ...], int | None]]] = {}
    _FOR: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, (types, minimum) in self._RULES.items():
            value = getattr(self, name)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                kinds = " or ".join("None" if t is type(None) else t.__name__ for t in types)
                raise TypeError(f"{self._FOR} option {name} must be {kinds}, got {type(value).__name__}")
            if minimum is not None and isinstance(value, int) and value < minimum:
                raise ValueError(f"{self._FOR} option {name} must be >= {minimum}, got {value}")

    @classmethod
    def from_dict(cls: type[_OptionsT], options: Mapping[str, Any]) -> _OptionsT:
        """The options of a dict of keyword arguments.

        Raises:
            TypeError: a key that is not a field (the message names it and lists the fields, or
                says which manager argument takes it), or a value of the wrong type.
            ValueError: a value out of range.
        """
        fields = [f.name for f in dataclasses.fields(cls)]
        options = dict(options)
        for key in options:
            if key in _MANAGER_OWNED:
                raise TypeError(f"{cls.__name__}: {key!r} is not a {cls._FOR} option here: {_MANAGER_OWNED[key]}")
            if key not in fields:
                raise TypeError(
                    f"{cls.__name__}: unknown {cls._FOR} option {key!r}; the options are {', '.join(fields)}"
                )
        return cls(**options)

    @classmethod
    def coerce(cls: type[_OptionsT], options: _OptionsT | Mapping[str, Any] | None) -> _OptionsT:
        """``options`` itself, the options of a dict (:meth:`from_dict`), or the defaults for None.

        Raises:
            TypeError, ValueError: as :meth:`from_dict`; TypeError for any other type.
        """
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if isinstance(options, Mapping) and not isinstance(options, _Options):
            return cls.from_dict(options)
        raise TypeError(f"{cls._FOR} options must be a {cls.__name__} or a dict, got {type(options).__name__}")

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments for the writer's or reader's constructor."""
        return dict(self)

    def __getitem__(self, name: str) -> Any:
        if name not in self._RULES:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return (f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))


@dataclass(frozen=True)
class WriterOptions(_Options):
    """Settings of the :class:`~uc_checkpoint.dcp.writer.UCVolumeWriter` each save creates.

    Attributes:
        upload_workers: files uploaded at once per rank (>= 1).
        thread_count: DCP serialisation threads per rank (>= 1).
        file_size_bytes: target size of one data file, in bytes (>= 1); smaller files start
            uploading sooner but cost more requests. None: sized from the rank's share (about 16
            files of 16-256 MiB, :func:`uc_checkpoint.dcp.serialize.auto_file_size`).
        overwrite: a save may replace a checkpoint already published at its step's location (the
            old one stays loadable until the new ``.metadata`` replaces it).
        create_parents: create missing parent directories of a local location.
        sync_files: fsync data files and ``.metadata`` on the volume before publishing.
        spread_prefixes: spread each save's data files over this many key prefixes inside its
            location (1 to 256; 1: the flat layout), for stores that limit requests per prefix (S3:
            about 3,500 writes/s). None: automatic, flat except on S3 from 256 ranks on (one
            prefix per 32 ranks). See :class:`~uc_checkpoint.dcp.writer.UCVolumeWriter`.

    The staging directory and the volume's options are the manager's own arguments
    (``staging_dir=``, ``volume_options=``).

    Raises:
        TypeError: a field of the wrong type (an int field given a bool, say).
        ValueError: a count or size below its minimum, or ``spread_prefixes`` above 256.
    """

    _RULES: ClassVar[dict[str, tuple[tuple[type, ...], int | None]]] = {
        "upload_workers": ((int,), 1),
        "thread_count": ((int,), 1),
        "file_size_bytes": ((int, type(None)), 1),
        "overwrite": ((bool,), None),
        "create_parents": ((bool,), None),
        "sync_files": ((bool,), None),
        "spread_prefixes": ((int, type(None)), 1),
    }
    _FOR: ClassVar[str] = "writer"

    upload_workers: int = 4
    thread_count: int = 1
    file_size_bytes: int | None = None
    overwrite: bool = True
    create_parents: bool = True
    sync_files: bool = True
    spread_prefixes: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.spread_prefixes is not None and self.spread_prefixes > MAX_SPREAD_PREFIXES:
            raise ValueError(
                f"writer option spread_prefixes must be <= {MAX_SPREAD_PREFIXES}, got {self.spread_prefixes}"
            )


@dataclass(frozen=True)
class ReaderOptions(_Options):
    """Settings of the :class:`~uc_checkpoint.dcp.reader.UCVolumeReader` each load (and each check of a
    checkpoint's ``.metadata``) creates.

    Attributes:
        download_workers: files (or byte ranges) fetched at once per rank (>= 1).
        verify_checksums: check every fetched byte against the CRC-32s in the checkpoint's
            manifest (of whole files, or of each 4 MiB block a ranged read covers).
        prefetch_files: True: download each needed file whole into staging, then read it. False:
            fetch only the byte ranges the load plan needs, into memory. None: ranges on object
            stores and fsspec volumes, whole files on local and FUSE paths.
        max_inflight_bytes: fetched bytes (>= 1) ranged reads hold in memory before they are
            deserialised (one range larger than this is fetched alone).
        range_gap_bytes: ranges of one file closer than this many bytes (>= 0) are fetched as one.
        range_chunk_bytes: largest single ranged GET in bytes (>= 64 KiB); bigger ranges are fetched
            as parallel pieces of this size.
        allow_unsafe_metadata: unpickle ``.metadata`` with plain :func:`pickle.loads`. **Risk:**
            whoever can write to the root can then run code in this process; see
            :class:`~uc_checkpoint.dcp.reader.UCVolumeReader`.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a count or size below its minimum.
    """

    _RULES: ClassVar[dict[str, tuple[tuple[type, ...], int | None]]] = {
        "download_workers": ((int,), 1),
        "verify_checksums": ((bool,), None),
        "prefetch_files": ((bool, type(None)), None),
        "max_inflight_bytes": ((int,), 1),
        "range_gap_bytes": ((int,), 0),
        "range_chunk_bytes": ((int,), MIN_CHUNK_BYTES),
        "allow_unsafe_metadata": ((bool,), None),
    }
    _FOR: ClassVar[str] = "reader"

    download_workers: int = 4
    verify_checksums: bool = True
    prefetch_files: bool | None = None
    max_inflight_bytes: int = 256 << 20
    range_gap_bytes: int = DEFAULT_GAP_BYTES
    range_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    allow_unsafe_metadata: bool = False


def check_manager_arguments(
    root: object,
    *,
    keep_last: int | None,
    keep_every: int | None,
    async_save: bool,
    async_mode: str,
    async_staging: bool,
    reuse_staging_buffers: bool,
    list_attempts: int,
) -> None:
    """The checks of :class:`~uc_checkpoint.ops.manager.CheckpointManager`'s own arguments (the
    meanings are documented there).

    Raises:
        TypeError: ``root`` is not a path, URL or Volume, or a count is not an int.
        ValueError: a value out of range, or options that do not go together (each message names
            them).
    """
    if not isinstance(root, (str, os.PathLike, Volume)):
        raise TypeError(f"root must be a path, URL or Volume, got {type(root).__name__}")
    for arg, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{arg} must be an int or None, got {type(value).__name__}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    if async_mode not in ("thread", "process"):
        raise ValueError(f"async_mode must be 'thread' or 'process', got {async_mode!r}")
    if async_staging and not async_save:
        raise ValueError("async_staging=True needs async_save=True (a synchronous save stages nothing)")
    if reuse_staging_buffers and (not async_save or async_staging or async_mode != "thread"):
        raise ValueError(
            "reuse_staging_buffers=True needs async_save=True, async_staging=False and async_mode='thread' "
            "(it keeps the writer's own staging copy, which PROCESS mode hands to DCP's daemon)"
        )
    if list_attempts < 1:
        raise ValueError(f"list_attempts must be >= 1, got {list_attempts}")


def check_timeout(timeout: object) -> timedelta | None:
    """``CheckpointManager(timeout=...)`` as a ``timedelta``: seconds (an int or float) or a
    ``timedelta``, finite and > 0; None stays None (the process group's timeout applies).

    Raises:
        TypeError: ``timeout`` is neither (a bool is not a number of seconds).
        ValueError: it is under a millisecond (zero, negative), NaN, infinite or past
            ``timedelta``'s range.
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (a number) or a datetime.timedelta, got {type(timeout).__name__}")
    # gloo and the c10d store count in milliseconds: less than one would be no wait at all.
    if not math.isfinite(seconds) or seconds < 0.001:
        raise ValueError(f"timeout must be a finite number of seconds, at least 0.001, got {timeout!r}")
    try:
        return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(
            f"timeout must be at most {timedelta.max.total_seconds():g} seconds, got {timeout!r}"
        ) from None


__all__ = ["check_manager_arguments", "check_timeout", "ReaderOptions", "WriterOptions"]
