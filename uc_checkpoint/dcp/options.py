"""The settings of the writer, the reader and a manager's saves: each declared, defaulted and
checked here, once.

- :class:`WriterOptions`: what :class:`~uc_checkpoint.dcp.writer.UCVolumeWriter` does with a save
  (``UCVolumeWriter(path, options=WriterOptions(...))``); the keyword arguments it takes from DCP's
  ``FileSystemWriter`` (``thread_count=``, ``sync_files=``, ...) replace the field of the same name.
- :class:`ReaderOptions`: the same for :class:`~uc_checkpoint.dcp.reader.UCVolumeReader`.
- :class:`Staging`: how :class:`~uc_checkpoint.ops.manager.CheckpointManager` runs its saves
  (DCP's ``AsyncCheckpointerType`` or a synchronous save, the copy to CPU memory in the background
  or not, the copy's memory kept between saves or not); a combination that cannot work cannot be
  built.

All three are frozen dataclasses whose ``__post_init__`` checks every field (the shape of
s3transfer's ``TransferConfig``): a bad value raises at once, naming the class and the field. To
change one field, ``dataclasses.replace(options, field=value)`` (checked again).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from uc_checkpoint.engine.ranges import DEFAULT_CHUNK_BYTES, DEFAULT_GAP_BYTES, MIN_CHUNK_BYTES
from uc_checkpoint.format.layout import MAX_SPREAD_PREFIXES

#: Field -> (accepted types, smallest value or None) of an options class; bool is never an int.
_Rules = dict[str, tuple[tuple[type, ...], int | None]]


def _article(t: type) -> str:
    return "None" if t is type(None) else f"{'an' if t.__name__[0] in 'aeiou' else 'a'} {t.__name__}"


def _check(owner: object, rules: _Rules, notes: dict[str, str] | None = None) -> None:
    """Check each field of ``owner`` against ``rules``; ``notes`` (field -> why) explain a minimum.

    Raises:
        TypeError: ``<Class>.<field> must be ..., got <type>``.
        ValueError: ``<Class>.<field> must be >= <minimum>, got <value>``.
    """
    cls = type(owner).__name__
    assert set(rules) == {f.name for f in fields(owner)}  # type: ignore[arg-type]  # every field has a rule
    for name, (types, minimum) in rules.items():
        value = getattr(owner, name)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            kinds = " or ".join(_article(t) for t in types)
            raise TypeError(f"{cls}.{name} must be {kinds}, got {type(value).__name__}")
        if minimum is not None and isinstance(value, int) and not isinstance(value, bool) and value < minimum:
            why = (notes or {}).get(name)
            raise ValueError(f"{cls}.{name} must be >= {minimum}{f' ({why})' if why else ''}, got {value}")


@dataclass(frozen=True)
class WriterOptions:
    """Settings of a :class:`~uc_checkpoint.dcp.writer.UCVolumeWriter`.

    Attributes:
        upload_workers: files uploaded at once per rank (>= 1).
        thread_count: DCP serialisation threads per rank (>= 1), as ``FileSystemWriter``'s.
        file_size_bytes: target size of one data file, in bytes (>= 1); smaller files start
            uploading sooner but cost more requests. None: sized from the rank's share (about 16
            files of 16-256 MiB, :func:`uc_checkpoint.dcp.serialize.auto_file_size`).
        single_file_per_rank: as ``FileSystemWriter``'s: True gives ``thread_count`` files per
            rank, False one file per item; None (default): files of ``file_size_bytes``. Not with
            ``file_size_bytes`` (both choose the data files).
        per_thread_copy_ahead: bytes (>= 0) of an accelerator's tensors copied to the CPU ahead of
            serialisation in a synchronous save with one thread, as ``FileSystemWriter``'s.
        overwrite: a save may replace a checkpoint already published at its location (the old one
            stays loadable until the new ``.metadata`` replaces it).
        create_parents: create missing parent directories of a local location.
        sync_files: fsync data files and ``.metadata`` on the volume before publishing.
        spread_prefixes: spread a save's data files over this many key prefixes inside its
            location (1 to 256; 1: the flat layout): rank ``r``'s files go to
            ``<r % spread_prefixes in hex>/__<r>_...distcp``, so that a store which limits requests
            per prefix (S3: about 3,500 writes/s before ``503 SlowDown``) serves a save of thousands
            of ranks from several partitions. None (default): flat, except on S3 for saves of at
            least 256 ranks, which get one prefix per 32 ranks. Stock DCP readers load either layout.

    Raises:
        TypeError: a field of the wrong type (an int field given a bool, say).
        ValueError: a count or size below its minimum, ``spread_prefixes`` above 256, or
            ``single_file_per_rank`` with ``file_size_bytes``.
    """

    upload_workers: int = 4
    thread_count: int = 1
    file_size_bytes: int | None = None
    single_file_per_rank: bool | None = None
    per_thread_copy_ahead: int = 10_000_000
    overwrite: bool = True
    create_parents: bool = True
    sync_files: bool = True
    spread_prefixes: int | None = None

    def __post_init__(self) -> None:
        _check(
            self,
            {
                "upload_workers": ((int,), 1),
                "thread_count": ((int,), 1),
                "file_size_bytes": ((int, type(None)), 1),
                "single_file_per_rank": ((bool, type(None)), None),
                "per_thread_copy_ahead": ((int,), 0),
                "overwrite": ((bool,), None),
                "create_parents": ((bool,), None),
                "sync_files": ((bool,), None),
                "spread_prefixes": ((int, type(None)), 1),
            },
        )
        if self.spread_prefixes is not None and self.spread_prefixes > MAX_SPREAD_PREFIXES:
            raise ValueError(
                f"WriterOptions.spread_prefixes must be <= {MAX_SPREAD_PREFIXES}, got {self.spread_prefixes}"
            )
        if self.single_file_per_rank is not None and self.file_size_bytes is not None:
            raise ValueError(
                "WriterOptions: pass single_file_per_rank or file_size_bytes, not both: both choose the data files"
            )


@dataclass(frozen=True)
class ReaderOptions:
    """Settings of a :class:`~uc_checkpoint.dcp.reader.UCVolumeReader`.

    Attributes:
        download_workers: files (or byte ranges) fetched at once per rank (>= 1).
        verify_checksums: check every fetched byte against the CRC-32s recorded in the
            checkpoint's manifest: of the whole file, or of each 4 MiB block a ranged read covers
            (checkpoints without a manifest, such as stock ``FileSystemWriter`` ones, are checked
            for size, plus the zip CRC-32 of each tensor item up to 256 KiB).
        prefetch_files: True: download each needed file whole into staging, then read it. False:
            fetch only the byte ranges the load plan needs, into memory. None (default): ranges on
            object stores and fsspec volumes, whole files on local and FUSE paths.
        max_inflight_bytes: fetched bytes (>= 1) ranged reads hold in memory before they are
            deserialised (one range larger than this is fetched alone; a range received into a
            reused buffer may occupy up to a quarter more).
        range_gap_bytes: ranges of one file closer than this many bytes (>= 0) are fetched as one.
        range_chunk_bytes: largest single ranged GET in bytes (>= 64 KiB: each piece is one
            request); bigger ranges are fetched as parallel pieces of this size.
        allow_unsafe_metadata: unpickle ``.metadata`` with plain :func:`pickle.loads`. By default
            it may name only the classes DCP's metadata is made of
            (:data:`uc_checkpoint.dcp.metadata_io.ALLOWED_GLOBALS` and torch dtypes). **Risk:**
            a ``.metadata`` pickle can name any function, so with True whoever could write to the
            checkpoint location can run code in this process. Set it only for checkpoints you
            trust whose metadata holds extra objects (e.g. a custom planner's ``planner_data``).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a count or size below its minimum.
    """

    download_workers: int = 4
    verify_checksums: bool = True
    prefetch_files: bool | None = None
    max_inflight_bytes: int = 256 << 20
    range_gap_bytes: int = DEFAULT_GAP_BYTES
    range_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    allow_unsafe_metadata: bool = False

    def __post_init__(self) -> None:
        _check(
            self,
            {
                "download_workers": ((int,), 1),
                "verify_checksums": ((bool,), None),
                "prefetch_files": ((bool, type(None)), None),
                "max_inflight_bytes": ((int,), 1),
                "range_gap_bytes": ((int,), 0),
                "range_chunk_bytes": ((int,), MIN_CHUNK_BYTES),
                "allow_unsafe_metadata": ((bool,), None),
            },
            notes={"range_chunk_bytes": "64 KiB; each piece is one request"},
        )


#: How a manager's save runs: DCP's ``AsyncCheckpointerType`` (``"thread"``, ``"process"``) or a
#: synchronous ``dcp.save`` (``"sync"``).
StagingMode = Literal["thread", "process", "sync"]
_MODES = ("thread", "process", "sync")


@dataclass(frozen=True)
class Staging:
    """How :class:`~uc_checkpoint.ops.manager.CheckpointManager` runs each save: one value for
    what DCP spreads over ``async_save``'s arguments and its ``StagingOptions``.

    Attributes:
        mode: ``"thread"`` (default): ``dcp.async_save`` in a thread of DCP's; training resumes
            once the state is copied to CPU memory. ``"process"``: ``dcp.async_save`` in DCP's
            checkpoint process (serialisation off the training process's GIL; needs a process
            group). ``"sync"``: ``dcp.save``, done when :meth:`CheckpointManager.save` returns.
        background_copy: copy the state to CPU memory in a thread of its own as well
            (:class:`~uc_checkpoint.dcp.stager.BackgroundStager`), so that ``save()`` returns
            after a few milliseconds instead of after one copy of the state. Off by default
            because it moves a duty to the training loop: call
            :meth:`CheckpointManager.wait_until_staged` after ``save()`` and before anything
            changes the state (``optimizer.step()``, a load into it). A state changed earlier
            fails the save (:class:`~uc_checkpoint.errors.StateChangedWhileStagingError`) rather
            than publish a checkpoint that mixes two steps. Not with ``mode="sync"``.
        reuse_buffers: keep the CPU copy of the state between saves and copy the next save's state
            into it (:class:`~uc_checkpoint.dcp.buffers.StagingBuffers`): ``save()`` blocks for a
            copy into memory already mapped rather than new memory (the kept-buffer rows of
            docs/benchmarks.md), and the copy of the rank's state stays allocated between saves.
            Only with ``mode="thread"`` and no ``background_copy`` (in PROCESS mode each snapshot
            goes to DCP's checkpoint process with its save: nothing to keep).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: an unknown mode, or a combination that cannot work (the message names both).
    """

    mode: StagingMode = "thread"
    background_copy: bool = False
    reuse_buffers: bool = False

    def __post_init__(self) -> None:
        _check(self, {"mode": ((str,), None), "background_copy": ((bool,), None), "reuse_buffers": ((bool,), None)})
        if self.mode not in _MODES:
            raise ValueError(f"Staging.mode must be one of {', '.join(map(repr, _MODES))}, got {self.mode!r}")
        if self.background_copy and self.mode == "sync":
            raise ValueError(
                "Staging: background_copy=True needs mode 'thread' or 'process' (a synchronous save stages nothing)"
            )
        if self.reuse_buffers and (self.mode != "thread" or self.background_copy):
            raise ValueError(
                "Staging: reuse_buffers=True needs mode='thread' and background_copy=False (it keeps the writer's "
                f"own staging copy, which PROCESS mode hands to DCP's checkpoint process), got mode={self.mode!r}, "
                f"background_copy={self.background_copy}"
            )

    @property
    def asynchronous(self) -> bool:
        """Whether saves use ``dcp.async_save`` (every mode but ``"sync"``)."""
        return self.mode != "sync"


__all__ = ["ReaderOptions", "Staging", "StagingMode", "WriterOptions"]
