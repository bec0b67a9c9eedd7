"""The exceptions uc_checkpoint raises.

Every error names the path, key or argument it is about. DCP wraps errors raised inside a save or a
load in its own ``CheckpointException`` (a ``BaseException``); ours are the inner causes there, one per
failing rank (``exc.failures[rank]``).
"""

from __future__ import annotations


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
    """The local staging directory cannot be created or written."""


class TransferError(UCCheckpointError):
    """Copying a file between staging and the volume failed (after any retries)."""


class CheckpointNotFoundError(UCCheckpointError):
    """A location has no published ``.metadata``: no checkpoint, or one whose save never finished."""


class CorruptCheckpointError(UCCheckpointError):
    """A checkpoint file is missing, truncated or fails its checksum. The message names the file."""


class DatasetMismatchError(UCCheckpointError, ValueError):
    """A saved data-tracker state was written for a different dataset (shard names, sample counts or
    order) than the one the tracker was built with. The message names the first shard that differs."""


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


class UnsafeMetadataError(CorruptCheckpointError):
    """A checkpoint's ``.metadata`` pickle names a global (a function or class) that is not part of
    DCP's metadata format, so it was not unpickled: loading it could run arbitrary code. The message
    names the file and the refused global. ``UCVolumeReader(..., allow_unsafe_metadata=True)`` trusts
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
