"""The catalog of step-numbered checkpoints under one root: what exists, whether it is intact, which
is the latest.

A root holds one location per checkpoint, ``step_<8 digits>`` (:func:`checkpoint_name`). Each is
described by one record, :class:`CheckpointInfo`, in one of four states:

* ``"incomplete"``: no ``.metadata`` (a save in progress, or one that failed);
* ``"broken"``: published, but a data file is missing or short, or the ``.metadata`` does not
  decode (or is unsafe); ``problem`` says which;
* ``"abandoned"``: intact, but on a branch a rollback left (:mod:`uc_checkpoint.ops.lineage`);
* ``"complete"``: published, every data file there with its recorded size, not abandoned.

:func:`list_steps` only lists (one LIST of the root and a HEAD of each ``.metadata``);
:func:`inspect_step` reads one location's ``.metadata`` and listing; :func:`latest` is the newest
complete checkpoint (or, with ``intact=False``, the newest published one). The manager's
``latest()``, ``uc-checkpoint ls``, ``verify``, ``gc`` and the demo all use these.

A checkpoint is ``"broken"`` only on evidence of damage. A store that fails to answer proves
nothing about a checkpoint: its errors (:class:`~uc_checkpoint.errors.TransferError`,
:class:`~uc_checkpoint.errors.VolumeError`) are raised, never turned into a state.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from uc_checkpoint.dcp.metadata_io import data_file_names, manifest_of, read_metadata, referenced_files
from uc_checkpoint.engine.listing import checkpoint_entries, checkpoint_files
from uc_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, VolumeError
from uc_checkpoint.format.layout import ABANDONED_NAME, DATA_SUFFIX, METADATA_NAME, is_checkpoint_file, is_claim
from uc_checkpoint.format.manifest import entries_of
from uc_checkpoint.ops.lineage import abandonment_of
from uc_checkpoint.volumes import Volume, open_volume

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STEP_DIR = re.compile(r"^step_(\d+)/?$")

#: The states of :class:`CheckpointInfo`.
STATES = ("complete", "incomplete", "broken", "abandoned")


class Retry(Protocol):
    """How a store call is made: ``retry(what, fn)`` returns ``fn()``, possibly after retrying it
    (``what`` names the request for messages). The manager passes its own, with backoff."""

    def __call__(self, what: str, fn: Callable[[], T]) -> T: ...


def call_once(what: str, fn: Callable[[], T]) -> T:
    """A :class:`Retry` that makes each call once (the store's client has retried already)."""
    return fn()


@dataclass(frozen=True)
class CheckpointInfo:
    """One step location under a root.

    A listing (:func:`list_steps`) fills ``step``, ``name`` and ``published``, and ``state`` only
    for unpublished locations (``"incomplete"``); :func:`inspect_step` fills the rest.

    Attributes:
        step: the training step (from the ``step_NNNNNNNN`` name).
        name: the location's name under the root.
        published: its ``.metadata`` exists (the save finished); None when not looked up yet
            (a listing with ``published=False``: see :func:`is_published`).
        state: ``"complete"``, ``"incomplete"``, ``"broken"`` or ``"abandoned"`` (see the module
            docstring); None for a published location not inspected yet.
        problem: what is wrong with a broken checkpoint, which rollback abandoned an abandoned
            one, or why an inspected location turned out unpublished; else None.
        bytes: size in bytes of the checkpoint's own files: for a published checkpoint whose
            ``.metadata`` decodes, that ``.metadata``, its rollback marker if any and the data files
            it references that are there; otherwise every file at the location (None unless
            inspected with ``details``).
        files: number of data files counted in ``bytes`` (None unless inspected with ``details``).
        age_s: seconds since the newest of those files was written (None unless inspected with
            ``details``, or when the store has no times).
        abandoned: whether a rollback marker applies to the checkpoint; None when it was not
            looked at (unreadable or vanished ``.metadata``, or a broken one inspected for a listing).
        unreferenced_files: files a save writes (data files, save markers) at a published
            checkpoint's location that its ``.metadata`` does not reference: a killed or failed
            later save's leftovers (``uc-checkpoint gc`` removes them once old) or a save in
            progress there; not counted in ``files`` (None unless known: inspected with
            ``details``, ``.metadata`` decoded).
        unreferenced_bytes: their total size in bytes (None when ``unreferenced_files`` is).
    """

    step: int
    name: str
    published: bool | None
    state: str | None = None
    problem: str | None = None
    bytes: int | None = None
    files: int | None = None
    age_s: float | None = None
    abandoned: bool | None = None
    unreferenced_files: int | None = None
    unreferenced_bytes: int | None = None


def checkpoint_name(step: int) -> str:
    """The location name of the checkpoint of ``step`` under a root: ``step_00000042``.

    Raises:
        ValueError: ``step`` is negative.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def open_root(root: str | Volume, *, what: str = "checkpoint root", missing: str = "does not exist") -> Volume:
    """The volume of a root that must already exist (``ls``, ``gc``): ``root`` itself or
    :func:`~uc_checkpoint.volumes.open_volume` of it.

    Raises:
        VolumeError: it is a file ("<what> <url> is not a directory") or, on stores with
            directories, missing ("<what> <url> <missing>").
    """
    volume = root if isinstance(root, Volume) else open_volume(root)
    try:
        present = volume.exists()  # False only on stores with directories; a file raises
    except VolumeError as exc:
        raise VolumeError(f"{what} {volume.url} is not a directory") from exc
    if not present:
        raise VolumeError(f"{what} {volume.url} {missing}")
    return volume


def list_steps(root: Volume, *, published: bool = True) -> list[CheckpointInfo]:
    """Every step location under ``root``, oldest first: one listing of the root, then (with
    ``published``) the size of each location's ``.metadata`` (a HEAD on object stores).
    Unpublished ones are ``"incomplete"``; published ones are not inspected (``state`` None).

    ``published=False`` stops after the one listing: every record's ``published`` is None, for
    callers that look up only the few they need (:func:`is_published`), newest first, so that
    their cost does not grow with the number of checkpoints kept.

    Raises:
        TransferError / VolumeError: the root cannot be listed or a ``.metadata`` not looked up.
    """
    out = []
    for name in root.list_files():
        match = _STEP_DIR.match(name)
        if match:
            info = CheckpointInfo(int(match.group(1)), name.rstrip("/"), None)
            out.append(is_published(root, info) if published else info)
    return sorted(out, key=lambda i: (i.step, i.name))


def is_published(root: Volume, info: CheckpointInfo, retry: Retry = call_once) -> CheckpointInfo:
    """``info`` with ``published`` looked up (one ``.metadata`` size: a HEAD on object stores)
    when it is not known yet; unpublished ones get ``state="incomplete"``.

    Raises:
        TransferError / VolumeError: the lookup failed (after ``retry``).
    """
    if info.published is not None:
        return info
    location = root.child(info.name)
    found = retry(f"look up {info.name}/{METADATA_NAME}", lambda: location.size(METADATA_NAME)) is not None
    return replace(info, published=found, state=None if found else "incomplete")


def file_problems(location: Volume, metadata: Metadata, files: dict[str, int]) -> dict[str, str]:
    """What is wrong with the data files a published checkpoint references, judged from a listing
    (``files``: name -> bytes): ``{name: problem}`` for every file that is missing or has another
    size than the manifest recorded (or less than its items need). Empty when every file is there
    whole (checksums are :mod:`uc_checkpoint.ops.verify`'s job)."""
    exact = {name: entry.size for name, entry in entries_of(manifest_of(metadata)).items()}
    out: dict[str, str] = {}
    for name, least in sorted(referenced_files(metadata).items()):
        want = exact.get(name)
        if name not in files:
            out[name] = f"{location.url_of(name)} is missing"
        elif (want is not None and files[name] != want) or files[name] < least:
            out[name] = (
                f"{location.url_of(name)} has {files[name]} bytes, expected {want if want is not None else least}"
            )
    return out


def missing_or_short(location: Volume, metadata: Metadata, files: dict[str, int]) -> str | None:
    """The first of :func:`file_problems`, or None when the checkpoint's files are all there whole."""
    return next(iter(file_problems(location, metadata, files).values()), None)


def inspect_step(
    root: Volume,
    info: CheckpointInfo,
    *,
    retry: Retry = call_once,
    allow_unsafe: bool = False,
    details: bool = False,
    rollback_first: bool = False,
    now: float | None = None,
) -> CheckpointInfo:
    """``info`` with its state found out: for a published location, its ``.metadata`` is read and
    checked, its files listed against it, and a rollback marker read when the listing shows one.

    Args:
        root: the root ``info`` was listed under.
        info: a record from :func:`list_steps`.
        retry: how each store call is made (see :class:`Retry`).
        allow_unsafe: unpickle the ``.metadata`` without the allow-list (see
            :func:`uc_checkpoint.dcp.metadata_io.load_metadata`).
        details: also fill ``bytes``, ``files``, ``age_s`` and, for a published checkpoint, the
            ``unreferenced_*`` counts (for listings such as ``ls``; costs the location's
            modification times, and its listing also for unpublished locations; nothing more, since
            the ``.metadata`` that tells its own files from others is read anyway).
        rollback_first: look for a rollback marker even on a checkpoint with missing files, and
            let it decide the state (``"abandoned"``), as ``latest()`` does so that it records every
            abandoned step; otherwise (listings) a broken checkpoint is ``"broken"`` and its marker
            is not read.
        now: the time ages are measured from (Unix seconds; default: now).

    Requests: with ``details`` a LIST of the location (plus its times where the store keeps them
    apart), then the ``.metadata`` GET; without, the GET then the LIST. A checkpoint whose data
    files are spread over key prefixes costs one more LIST per prefix. A GET of the marker when
    the listing shows one. None without ``details`` for an unpublished location.

    Raises:
        TransferError / VolumeError: a request failed (after ``retry``); never a state.
    """
    location = root.child(info.name)
    files: dict[str, int] | None = None
    mtimes: dict[str, float] = {}
    stamp = time.time() if now is None else now
    out = info
    if details:
        # Sizes and times, one listing (and one per spread prefix the location holds).
        entries = retry(f"list {info.name}", lambda: checkpoint_entries(location))
        files = {e.name: e.size for e in entries if e.size >= 0}
        mtimes = {e.name: e.mtime for e in entries if not e.is_dir and e.mtime is not None}
        out = replace(out, **_counts(files, mtimes, stamp))
    if info.published is None and files is not None:
        out = replace(out, published=METADATA_NAME in files)  # the location's listing says it
    if out.published is False:
        return replace(out, state="incomplete")
    try:
        metadata = retry(
            f"read {info.name}/{METADATA_NAME}", lambda: read_metadata(location, allow_unsafe=allow_unsafe)
        )
    except CorruptCheckpointError as exc:
        return replace(out, state="broken", problem=str(exc))
    except CheckpointNotFoundError as exc:
        if out.published is None:  # not looked up before: a save that has not finished, not a problem
            return replace(out, published=False, state="incomplete")
        # Unpublished (retention, a re-save) since it was listed.
        return replace(out, published=False, state="incomplete", problem=f"no longer published: {exc}")
    out = replace(out, published=True)
    if files is None:
        files = retry(f"list {info.name}", lambda: checkpoint_files(location))
    elif details:
        # Only what the .metadata references is the checkpoint: a killed later save's data files
        # beside it stay until gc and made it look larger (and newer) than it is. Unreferenced is
        # gc's rule: names a save writes that this .metadata does not need.
        own = {METADATA_NAME, ABANDONED_NAME, *data_file_names(metadata)}
        unreferenced = {
            n: size for n, size in files.items() if n not in own and is_checkpoint_file(n) and not is_claim(n)
        }
        out = replace(
            out,
            **_counts({n: size for n, size in files.items() if n in own}, mtimes, stamp),
            unreferenced_files=len(unreferenced),
            unreferenced_bytes=sum(unreferenced.values()),
        )
    manifest = manifest_of(metadata)
    damage = None if rollback_first else missing_or_short(location, metadata, files)
    if damage is not None:
        return replace(out, state="broken", problem=damage)
    listing = files
    marker = retry(f"read {info.name}/{ABANDONED_NAME}", lambda: abandonment_of(location, manifest, listing))
    if marker is not None:
        return replace(out, state="abandoned", problem=marker, abandoned=True)
    damage = missing_or_short(location, metadata, files) if rollback_first else None
    return replace(out, state="broken" if damage else "complete", problem=damage, abandoned=False)


def _counts(counted: dict[str, int], mtimes: dict[str, float], now: float) -> dict[str, Any]:
    """``bytes``, ``files`` and ``age_s`` of :class:`CheckpointInfo` for the files ``counted``
    (name -> bytes; ``mtimes``: name -> Unix seconds, where the store keeps them)."""
    times = [mtimes[n] for n in counted if n in mtimes]
    return {
        "bytes": sum(counted.values()),
        "files": sum(1 for n in counted if n.endswith(DATA_SUFFIX)),
        "age_s": (now - max(times)) if times else None,
    }


def scan(root: Volume, *, now: float | None = None) -> list[CheckpointInfo]:
    """Every step location under ``root``, oldest first, each inspected with ``details`` (what
    ``uc-checkpoint ls`` shows).

    Raises:
        TransferError / VolumeError: the root, a location or a ``.metadata`` cannot be read.
    """
    stamp = time.time() if now is None else now
    # The root's listing, then per location its own listing (which shows .metadata) and a GET.
    return [inspect_step(root, info, details=True, now=stamp) for info in list_steps(root, published=False)]


def latest(
    root: Volume,
    *,
    intact: bool = True,
    retry: Retry = call_once,
    allow_unsafe: bool = False,
    infos: list[CheckpointInfo] | None = None,
    check: Callable[[CheckpointInfo], CheckpointInfo] | None = None,
    on_skip: Callable[[CheckpointInfo], None] | None = None,
) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` that is published and, with ``intact`` (the default),
    complete: its ``.metadata`` decodes, every data file it references is there with its recorded
    size, and no rollback abandoned it. Newer ones that are not are skipped (logged with why).
    ``intact=False``: the newest published one, nothing read but the listing. None when there is none.

    Args:
        retry: how each store call is made (see :class:`Retry`).
        allow_unsafe: see :func:`inspect_step`.
        infos: the root's listing when the caller has it already (:func:`list_steps`, with or
            without ``published``).
        check: inspects one published location (default: :func:`inspect_step` with
            ``rollback_first``, so that every abandoned step on the way is recognised as such).
        on_skip: called with each inspected location that is not complete (default: log it,
            at INFO for an abandoned one, else WARNING).

    Raises:
        TransferError / VolumeError: the root, a location or a ``.metadata`` cannot be read: a store
            error is never taken for "no checkpoint" or "broken" (that would silently resume from
            an older step).
    """
    # One listing, then newest first until one qualifies: the requests do not grow with the number
    # of checkpoints kept (an unpublished location costs the one request that finds it so).
    listed = infos if infos is not None else retry("list checkpoints", lambda: list_steps(root, published=False))
    for info in reversed(listed):
        if info.published is False:
            continue
        if not intact:
            info = is_published(root, info, retry)
            if info.published:
                return info
            continue
        checked = (
            check(info)
            if check is not None
            else inspect_step(root, info, retry=retry, allow_unsafe=allow_unsafe, rollback_first=True)
        )
        if checked.state == "complete":
            return checked
        if info.published is None and checked.published is False:
            continue  # a save that never finished: nothing to report
        if on_skip is not None:
            on_skip(checked)
        else:
            log = logger.info if checked.state == "abandoned" else logger.warning
            log("skipping checkpoint %s: %s", root.url_of(info.name), checked.problem)
    return None


# ---------------------------------------------------------------- kept for existing imports
# (uc_checkpoint.checkpoints, the module this catalog absorbed, gave these two.)


def list_checkpoints(root: Volume) -> list[tuple[int, str, bool]]:
    """``(step, name, published)`` for every step location under ``root``, oldest first.

    ``published`` is true when the location's ``.metadata`` exists: the save finished. New code uses
    :func:`list_steps`, which gives :class:`CheckpointInfo` records.
    """
    return [(info.step, info.name, bool(info.published)) for info in list_steps(root)]


def latest_checkpoint(root: Volume) -> tuple[int, str] | None:
    """``(step, name)`` of the newest published checkpoint under ``root``, or ``None``. It is not
    checked to be intact: new code uses :func:`latest`, which does."""
    found = latest(root, intact=False)
    return None if found is None else (found.step, found.name)


__all__ = [
    "STATES",
    "CheckpointInfo",
    "Retry",
    "call_once",
    "checkpoint_name",
    "file_problems",
    "inspect_step",
    "is_published",
    "latest",
    "latest_checkpoint",
    "open_root",
    "list_checkpoints",
    "list_steps",
    "missing_or_short",
    "scan",
]
