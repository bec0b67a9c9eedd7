"""The exceptions uc_checkpoint raises.

Every error names the path, key or argument it is about. DCP wraps errors raised inside a save or a
load in its own ``CheckpointException`` (a ``BaseException``); ours are the inner causes there, one per
failing rank (``exc.failures[rank]``).
"""

from __future__ import annotations

import builtins


class UCCheckpointError(Exception):
    """Base class of every error raised by uc_checkpoint."""


class VolumeError(UCCheckpointError):
    """A volume location cannot be used: it does not exist, is a file, is not writable or is
    unreachable. The message names the location."""


class LocationNotEmptyError(VolumeError):
    """A save was pointed at a location that holds files which are not part of a checkpoint."""


class CheckpointExistsError(VolumeError):
    """A save with ``overwrite=False`` found a published checkpoint at its location."""


class ConcurrentSaveError(UCCheckpointError):
    """Another save started at the same checkpoint location while this one ran; the newer save
    publishes and this one does not (nothing of it is published, so no checkpoint mixes the two).
    The message names the location and the other save."""


class StagingError(UCCheckpointError):
    """The local staging directory cannot be created or written (full, deleted mid-save, not this
    user's own). The message names the directory and the setting that moves staging:
    ``$UC_CHECKPOINT_STAGING_DIR`` or ``staging_dir=`` (``UCVolumeWriter``, ``UCVolumeReader``,
    ``CheckpointManager``)."""


class StateChangedWhileStagingError(UCCheckpointError):
    """A tensor of the state being saved was changed in place (e.g. by ``optimizer.step()``) while
    asynchronous staging was still copying it, so the copy may mix two training steps; the save is
    failed rather than published. Wait for the staging (``CheckpointManager.wait_until_staged()``
    or the ``staging_completion`` future of ``dcp.async_save``) before updating parameters."""


class TransferError(UCCheckpointError):
    """Copying a file between staging and the volume failed (after any retries)."""


class LandedSizeError(TransferError):
    """A small file's write was reported done, but read back it has another size on the volume (or
    is gone): the write was lost, or another writer replaced the file meanwhile. Raised by
    ``Volume.publish_bytes`` on volumes that check by reading back (local paths, FUSE mounts, fsspec)."""


class CheckpointNotFoundError(UCCheckpointError):
    """A location has no published ``.metadata``: no checkpoint, or one whose save never finished."""


class CorruptCheckpointError(UCCheckpointError):
    """A checkpoint file is missing, truncated or fails its checksum. The message names the file."""


class DatasetMismatchError(UCCheckpointError, ValueError):
    """A saved data-tracker state was written for a different dataset (shard names, sample counts,
    content fingerprints or order) than the one the tracker was built with. The message names the
    first shard that differs (and both fingerprints when its content changed)."""


class TrackerStateError(UCCheckpointError, ValueError):
    """A data-tracker state (the global state being loaded, or a rank's local state being gathered)
    is malformed or inconsistent: a missing or unknown key, a value of the wrong type, a negative
    count, remaining work that overlaps, is out of stream order or names a shard that does not
    exist. The message names the field. A ``ValueError`` too, as the tracker documented before."""


class DataLoadingError(UCCheckpointError):
    """A shard reader broke the tracker's contract (e.g. yielded fewer samples than asked for), a
    data loader was set up against its tracker (worker counts differ, ``drop_last`` without a
    batch-aligned tracker), or a loader iterator was used after the tracker's work was replaced
    (``start_epoch``, ``load_global_state``) or a newer iterator was started. The message names the
    shard or argument, or says which iterator to create instead."""


class ExactlyOnceError(DataLoadingError):
    """The end-of-epoch check found that the samples consumed in an epoch were not every sample
    exactly once (``DataTracker(exactly_once="raise")``). The message says how many samples were
    skipped or repeated and in which shards."""


class DataFormatError(DataLoadingError, ValueError):
    """A data shard cannot be read as the format its reader expects: truncated, not that format
    (bad magic, header or footer), a dtype or sequence length that does not fit it, a line that is
    not JSON, a cached index that does not describe it. The message names the file."""


class ItemChecksumError(CorruptCheckpointError, ValueError):
    """An item archive laid out exactly as its template whose storage record fails its CRC-32: the
    tensor's bytes were damaged after they were written (``torch.load`` would not notice). Raised
    by :meth:`uc_checkpoint.dcp.item_codec.ItemCodec.decode`; a ``ValueError`` too, as it was before it
    joined this hierarchy."""


class RemoteRankError(UCCheckpointError):
    """An operation one rank ran for the whole group (the manager's rank 0 lists, validates and
    prunes) failed with an exception outside this module's hierarchy and the builtin errors that
    can be rebuilt from a message (e.g. a third-party client's own error type). Every rank of the
    group raises this, the failing rank included (there with the original as ``__cause__``), so
    that ``except`` clauses match alike on every rank. The message names the operation, the
    location and the original ``Type: message``; :attr:`original_type` is the original's qualified
    class name."""

    def __init__(self, message: str, original_type: str = "") -> None:
        super().__init__(message)
        self.original_type = original_type


class PeerTimeoutError(UCCheckpointError, TimeoutError):
    """Another rank did not take part in one of the checkpoint manager's collectives or store
    exchanges within the job's timeout (a hung or stopped process, a frozen node, a network
    partition). The message names the operation, the timeout and the peer rank where it can be
    known. The manager's process groups are unusable afterwards: every later call of that manager
    raises this at once, and the job should exit (nothing of an unfinished save is published)."""


class UnsafeMetadataError(CorruptCheckpointError):
    """A checkpoint's ``.metadata`` pickle names a global (a function or class) that is not part of
    DCP's metadata format, so it was not unpickled: loading it could run arbitrary code. The message
    names the file and the refused global. ``UCVolumeReader(..., options=ReaderOptions(allow_unsafe_metadata=True))`` trusts
    such a file."""


def rank_error(exc: BaseException) -> BaseException:
    """The first failing rank's own exception when ``exc`` is DCP's ``CheckpointException`` (it
    stores ``(exception, traceback)`` per rank in ``failures``); otherwise ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    inner = next(iter(failures.values()))
    return inner[0] if isinstance(inner, tuple) else inner


def one_line(exc: BaseException) -> str:
    """``rank_error(exc)`` as ``"Type: message"`` on one line, for logs, records and the CLI."""
    inner = rank_error(exc)
    return f"{type(inner).__name__}: {inner}".splitlines()[0]


#: Builtin exceptions another rank may rebuild from a message alone (their constructors take one
#: string and print it back unchanged; KeyError, for one, quotes it and is left out).
_PORTABLE_BUILTINS = (
    "ValueError",
    "TypeError",
    "RuntimeError",
    "NotImplementedError",
    "TimeoutError",
    "OSError",
    "FileNotFoundError",
    "FileExistsError",
    "PermissionError",
    "IsADirectoryError",
    "NotADirectoryError",
    "ConnectionError",
)


def _portable_classes() -> dict[str, type[Exception]]:
    ours = {
        name: value
        for name, value in globals().items()
        if isinstance(value, type) and issubclass(value, UCCheckpointError) and value is not RemoteRankError
    }
    return {**{name: getattr(builtins, name) for name in _PORTABLE_BUILTINS}, **ours}


def portable_error(exc: BaseException) -> tuple[str, str] | None:
    """``(class name, message)`` another rank can rebuild ``exc`` from with :func:`rebuild_error`:
    the nearest class in ``exc``'s MRO that is defined in this module (or is one of a few builtin
    errors such as ``ValueError`` and ``OSError``), and ``str(exc)``. None when no such class is
    an ancestor (the caller raises :class:`RemoteRankError` on every rank instead).

    The receiving rank gets the same class as the sender whenever ``exc``'s own class is ours; for
    a subclass defined elsewhere it gets the nearest of ours, so ``except`` clauses naming our
    classes match alike on every rank."""
    known = _portable_classes()
    for cls in type(exc).__mro__:
        if known.get(cls.__name__) is cls:
            return cls.__name__, str(exc)
    return None


def rebuild_error(name: str, message: str) -> Exception:
    """The exception :func:`portable_error` described as ``(name, message)``; a
    :class:`RemoteRankError` when ``name`` is not one it produces (a newer peer's class, say)."""
    cls = _portable_classes().get(name)
    if cls is None:
        return RemoteRankError(f"{name}: {message}", original_type=name)
    return cls(message)
