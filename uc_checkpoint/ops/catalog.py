"""The catalog of step-numbered checkpoints under one root: what exists, whether it is intact, which
is the latest.

A root holds one location per checkpoint, ``step_<8 digits>`` (:func:`~uc_checkpoint.format.layout.checkpoint_name`). Each is
described by one record, :class:`CheckpointInfo`, in one of four states:

* ``"incomplete"``: no ``.metadata`` (a save in progress, or one that failed);
* ``"broken"``: published, but a data file is missing or short, or the ``.metadata`` does not
  decode (or is unsafe); ``problem`` says which;
* ``"abandoned"``: intact, but on a branch a rollback left (:mod:`uc_checkpoint.ops.lineage`);
* ``"complete"``: published, every data file there with its recorded size, not abandoned.

:func:`list_steps` only lists: one recursive listing of the root shows which locations hold a
``.metadata`` (:func:`list_step_entries` also gives each location's files); :func:`inspect_step`
reads one location's ``.metadata`` and checks its files; :func:`scan` is what ``uc-checkpoint ls``
shows; :func:`latest` is the newest complete checkpoint (or, with ``intact=False``, the newest
published one). The manager's ``list()`` and ``latest()``, ``ls``, ``verify``, ``gc`` and the demo
all use these. None of them reads every checkpoint kept, except ``gc`` and ``ls --check all``, which
must (they read the ``.metadata`` files a few at a time); docs/operating.md counts their requests.

Decoding a ``.metadata`` for real needs torch (its pickle names torch's classes; importing torch
takes seconds). A listing needs only what the ``.metadata`` references, which
:func:`~uc_checkpoint.format.metadata_peek.peek_metadata` reads without torch (``inspect_step``'s
``peek``): :func:`scan`, and so ``uc-checkpoint ls`` in every ``--check`` mode, imports no torch.
What loads or deletes (the manager's ``latest()``, ``verify``, ``gc``) decodes it fully, through
:mod:`uc_checkpoint.dcp.metadata_io`, which imports torch when first used.

A checkpoint is ``"broken"`` only on evidence of damage. A store that fails to answer proves
nothing about a checkpoint: its errors (:class:`~uc_checkpoint.errors.TransferError`,
:class:`~uc_checkpoint.errors.VolumeError`) are raised, never turned into a state.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from uc_checkpoint.engine.listing import (
    checkpoint_entries,
    checkpoint_files,
    in_parallel,
    locations_below,
    remove_empty_spread_dirs,
)
from uc_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, VolumeError
from uc_checkpoint.format.layout import (
    ABANDONED_NAME,
    DATA_SUFFIX,
    METADATA_NAME,
    STEP_PREFIX,
    checkpoint_name,
    is_checkpoint_file,
    is_claim,
    step_of,
)
from uc_checkpoint.format.manifest import entries_of
from uc_checkpoint.format.metadata_peek import PeekedMetadata, peek_metadata
from uc_checkpoint.ops.lineage import abandonment_of
from uc_checkpoint.volumes import Entry, Volume, open_volume

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The states of :class:`CheckpointInfo`.
STATES = ("complete", "incomplete", "broken", "abandoned")

#: Which published checkpoints :func:`scan` inspects (reads the ``.metadata`` of): ``"none"``,
#: ``"latest"`` (newest first until one is complete, as :func:`latest` does) or ``"all"``.
CHECKS = ("none", "latest", "all")


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
    for unpublished locations (``"incomplete"``); :func:`inspect_step` fills the rest (and
    :func:`scan` the sizes of the published locations it does not inspect).

    Attributes:
        step: the training step (from the ``step_NNNNNNNN`` name).
        name: the location's name under the root.
        published: its ``.metadata`` exists (the save finished); None when not looked up yet
            (a listing with ``published=False``: see :func:`is_published`).
        state: ``"complete"``, ``"incomplete"``, ``"broken"`` or ``"abandoned"`` (see the module
            docstring); None for a published location not inspected (not known to be intact).
        problem: what is wrong with a broken checkpoint, which rollback abandoned an abandoned
            one, or why an inspected location turned out unpublished; else None.
        bytes: size in bytes of the checkpoint's own files: for a published checkpoint whose
            ``.metadata`` decodes, that ``.metadata``, its rollback marker if any and the data files
            it references that are there; for a published one not inspected (:func:`scan`), every
            file a save writes there but the claim (another save's leftovers included); otherwise
            every file at the location (None unless inspected with ``details`` or scanned).
        files: number of data files counted in ``bytes`` (None unless inspected with ``details``
            or scanned).
        age_s: seconds since the newest of those files was written (None unless inspected with
            ``details`` or scanned, or when the store has no times).
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
    """Every step location under ``root``, oldest first. Unpublished ones are ``"incomplete"``;
    published ones are not inspected (``state`` None).

    ``published=True``: one recursive listing of the root (:func:`list_step_entries`), which shows
    each location's ``.metadata``: on S3 a request per 1,000 keys under the root, not one per
    checkpoint. ``published=False``: one listing of the root itself (a request per 1,000 locations),
    every record's ``published`` None, for callers that look up only the few they need
    (:func:`is_published`), newest first, whatever the number of files each checkpoint has.

    Raises:
        TransferError / VolumeError: the root cannot be listed.
    """
    if published:
        return [info for info, _entries in list_step_entries(root)]
    out = []
    for name in root.list_files():
        step = step_of(name)
        if step is not None:
            out.append(CheckpointInfo(step, name.rstrip("/"), None))
    return sorted(out, key=lambda i: (i.step, i.name))


def list_step_entries(root: Volume) -> list[tuple[CheckpointInfo, list[Entry]]]:
    """Every step location under ``root``, oldest first, with its entries (as
    :func:`~uc_checkpoint.engine.listing.checkpoint_entries` gives them: spread prefixes included),
    from one recursive listing of the root (:func:`~uc_checkpoint.engine.listing.locations_below`).
    ``published`` is whether the entries hold a ``.metadata``; unpublished ones are ``"incomplete"``.

    Requests: on S3 one per 1,000 keys below ``<root>/step_``; on local and FUSE paths and fsspec
    URLs one listing per directory.

    Raises:
        TransferError / VolumeError: the root cannot be listed.
    """
    out = []
    for name, entries in locations_below(root, STEP_PREFIX).items():
        step = step_of(name)
        if step is not None:
            found = any(e.name == METADATA_NAME and not e.is_dir for e in entries)
            out.append((CheckpointInfo(step, name, found, None if found else "incomplete"), entries))
    return sorted(out, key=lambda pair: (pair[0].step, pair[0].name))


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


def references_of(metadata: Metadata | PeekedMetadata) -> PeekedMetadata:
    """What a checkpoint's ``.metadata`` references (its manifest and its data files' least sizes),
    whether it was decoded (``Metadata``, :func:`uc_checkpoint.dcp.metadata_io.read_metadata`) or
    peeked at (:func:`~uc_checkpoint.format.metadata_peek.peek_metadata`)."""
    if isinstance(metadata, PeekedMetadata):
        return metadata
    from uc_checkpoint.dcp.metadata_io import manifest_of, referenced_files  # torch, loaded with `metadata`

    return PeekedMetadata(manifest=manifest_of(metadata), referenced=referenced_files(metadata))


def file_problems(location: Volume, metadata: Metadata | PeekedMetadata, files: dict[str, int]) -> dict[str, str]:
    """What is wrong with the data files a published checkpoint references, judged from a listing
    (``files``: name -> bytes): ``{name: problem}`` for every file that is missing or has another
    size than the manifest recorded (or less than its items need). Empty when every file is there
    whole (checksums are :mod:`uc_checkpoint.ops.verify`'s job). ``metadata``: its ``.metadata``,
    decoded or peeked at (:func:`references_of`)."""
    references = references_of(metadata)
    exact = {name: entry.size for name, entry in entries_of(references.manifest).items()}
    out: dict[str, str] = {}
    for name, least in sorted(references.referenced.items()):
        want = exact.get(name)
        if name not in files:
            out[name] = f"{location.url_of(name)} is missing"
        elif (want is not None and files[name] != want) or files[name] < least:
            out[name] = (
                f"{location.url_of(name)} has {files[name]} bytes, expected {want if want is not None else least}"
            )
    return out


def missing_or_short(location: Volume, metadata: Metadata | PeekedMetadata, files: dict[str, int]) -> str | None:
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
    entries: Sequence[Entry] | None = None,
    peek: bool = False,
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
        entries: the location's entries when the caller has them already (a root's recursive
            listing, :func:`list_step_entries`): the location is not listed again.
        peek: read the ``.metadata`` without torch
            (:func:`~uc_checkpoint.format.metadata_peek.peek_metadata`: the same checks, with the
            same messages, but for those of the items, which only a load acts on), for listings;
            otherwise (and with ``allow_unsafe``) decode it fully
            (:func:`uc_checkpoint.dcp.metadata_io.read_metadata`, which imports torch).

    Requests: with ``details`` a LIST of the location (plus its times where the store keeps them
    apart), then the ``.metadata`` GET; without, the GET then the LIST. A checkpoint whose data
    files are spread over key prefixes costs one more LIST per prefix. No LIST with ``entries``.
    A GET of the marker when the listing shows one. None for an unpublished location when the
    listing (``details`` or ``entries``) says so.

    Raises:
        TransferError / VolumeError: a request failed (after ``retry``); never a state.
    """
    location = root.child(info.name)
    files: dict[str, int] | None = None
    mtimes: dict[str, float] = {}
    stamp = time.time() if now is None else now
    out = info
    if details and entries is None:
        # Sizes and times, one listing (and one per spread prefix the location holds).
        entries = retry(f"list {info.name}", lambda: checkpoint_entries(location))
    if entries is not None:
        files = {e.name: e.size for e in entries if e.size >= 0}
        mtimes = {e.name: e.mtime for e in entries if not e.is_dir and e.mtime is not None}
    if details and files is not None:
        out = replace(out, **_counts(files, mtimes, stamp))
    if info.published is None and files is not None:
        out = replace(out, published=METADATA_NAME in files)  # the location's listing says it
    if out.published is False:
        return replace(out, state="incomplete")
    try:
        metadata = retry(
            f"read {info.name}/{METADATA_NAME}",
            lambda: _peek(location) if peek and not allow_unsafe else _decode(location, allow_unsafe),
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
        own = {METADATA_NAME, ABANDONED_NAME, *metadata.file_names()}
        unreferenced = {
            n: size for n, size in files.items() if n not in own and is_checkpoint_file(n) and not is_claim(n)
        }
        out = replace(
            out,
            **_counts({n: size for n, size in files.items() if n in own}, mtimes, stamp),
            unreferenced_files=len(unreferenced),
            unreferenced_bytes=sum(unreferenced.values()),
        )
    manifest = metadata.manifest
    damage = None if rollback_first else missing_or_short(location, metadata, files)
    if damage is not None:
        return replace(out, state="broken", problem=damage)
    listing = files
    marker = retry(f"read {info.name}/{ABANDONED_NAME}", lambda: abandonment_of(location, manifest, listing))
    if marker is not None:
        return replace(out, state="abandoned", problem=marker, abandoned=True)
    damage = missing_or_short(location, metadata, files) if rollback_first else None
    return replace(out, state="broken" if damage else "complete", problem=damage, abandoned=False)


def _peek(location: Volume) -> PeekedMetadata:
    """What the ``.metadata`` at ``location`` references, read without torch (one GET).

    Raises:
        CheckpointNotFoundError: it does not exist (worded as
            :func:`uc_checkpoint.dcp.metadata_io.read_metadata` words it).
        UnsafeMetadataError / CorruptCheckpointError: see
            :func:`~uc_checkpoint.format.metadata_peek.peek_metadata`.
        TransferError / VolumeError: the store failed to return it.
    """
    raw = location.read_bytes(METADATA_NAME)
    if raw is None:
        raise CheckpointNotFoundError(
            f"no checkpoint at {location.url}: {location.url_of(METADATA_NAME)} does not exist "
            "(never saved, or the save did not finish)"
        )
    return peek_metadata(raw, location.url_of(METADATA_NAME))


def _decode(location: Volume, allow_unsafe: bool) -> PeekedMetadata:
    """What the ``.metadata`` at ``location`` references, decoded and checked in full (imports torch).

    Raises:
        as :func:`uc_checkpoint.dcp.metadata_io.read_metadata`.
    """
    from uc_checkpoint.dcp.metadata_io import read_metadata  # needs torch

    return references_of(read_metadata(location, allow_unsafe=allow_unsafe))


def _counts(counted: dict[str, int], mtimes: dict[str, float], now: float) -> dict[str, Any]:
    """``bytes``, ``files`` and ``age_s`` of :class:`CheckpointInfo` for the files ``counted``
    (name -> bytes; ``mtimes``: name -> Unix seconds, where the store keeps them)."""
    times = [mtimes[n] for n in counted if n in mtimes]
    return {
        "bytes": sum(counted.values()),
        "files": sum(1 for n in counted if n.endswith(DATA_SUFFIX)),
        "age_s": (now - max(times)) if times else None,
    }


def scan(root: Volume, *, check: str = "latest", now: float | None = None) -> list[CheckpointInfo]:
    """Every step location under ``root``, oldest first, with sizes, file counts and ages (what
    ``uc-checkpoint ls`` shows), from one recursive listing of the root (:func:`list_step_entries`).

    Args:
        check: which published checkpoints are inspected (:func:`inspect_step` with ``details``:
            their ``.metadata`` read and their files checked against it), one of :data:`CHECKS`:
            ``"latest"`` (default) newest first until one is complete, as :func:`latest` picks it,
            so that the row of the checkpoint a resume loads, and of every newer one, says whether
            it is intact; ``"all"`` every one, a few at a time (``READ_THREADS``); ``"none"`` none.
            A published checkpoint not inspected has ``state`` None and counts every file a save
            writes there but the claim (see :class:`CheckpointInfo`). Each ``.metadata`` is read
            without torch (``inspect_step``'s ``peek``), so no mode imports torch.
        now: the time ages are measured from (Unix seconds; default: now).

    Requests: the listing's (on S3 one per 1,000 keys under the root), then per checkpoint
    inspected a GET of its ``.metadata`` (and of its rollback marker when it has one): with
    ``"latest"`` one in the usual case, however many checkpoints the root keeps.

    Raises:
        ValueError: ``check`` is not one of :data:`CHECKS`.
        TransferError / VolumeError: the root or a ``.metadata`` cannot be read.
    """
    if check not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(CHECKS)}; got {check!r}")
    stamp = time.time() if now is None else now
    listed = list_step_entries(root)
    entries_of = {info.name: entries for info, entries in listed}
    rows = {info.name: _as_listed(info, entries, stamp) for info, entries in listed}

    def inspect(info: CheckpointInfo) -> CheckpointInfo:
        return inspect_step(root, info, details=True, now=stamp, entries=entries_of[info.name], peek=True)

    if check == "all":
        for checked in in_parallel(inspect, [info for info, _entries in listed if info.published]):
            rows[checked.name] = checked
    elif check == "latest":
        inspected: list[CheckpointInfo] = []
        found = latest(root, infos=[info for info, _entries in listed], check=inspect, on_skip=inspected.append)
        for checked in [*inspected, *([found] if found is not None else [])]:
            rows[checked.name] = checked
    return [rows[info.name] for info, _entries in listed]


def _as_listed(info: CheckpointInfo, entries: Sequence[Entry], now: float) -> CheckpointInfo:
    """``info`` with the counts its listing gives, without reading anything: every file for an
    unpublished location, every file a save writes but the claim for a published one."""
    files = {e.name: e.size for e in entries if e.size >= 0}
    if info.published:
        files = {n: size for n, size in files.items() if is_checkpoint_file(n) and not is_claim(n)}
    mtimes = {e.name: e.mtime for e in entries if not e.is_dir and e.mtime is not None}
    return replace(info, **_counts(files, mtimes, now))


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


#: Name of the pointer file under a root: JSON ``{"step", "name", "location", "time"}``.
POINTER_NAME = "latest"


def write_pointer(root: Volume, step: int) -> None:
    """Write ``root``'s ``latest`` pointer file (:data:`POINTER_NAME`; one whole-file write, no
    symlink: FUSE mounts often lack them): ``{"step": int, "name": "step_...", "location": URL,
    "time": unix seconds}``. Tools may read it; :func:`latest` does not trust it and lists instead.

    Raises:
        TransferError: the write failed.
    """
    name = checkpoint_name(step)
    body = {"step": step, "name": name, "location": root.url_of(name), "time": time.time()}
    root.publish_bytes(POINTER_NAME, (json.dumps(body) + "\n").encode(), overwrite=True)


def read_pointer(root: Volume) -> dict[str, Any] | None:
    """``root``'s ``latest`` pointer's content, or None when there is none or it is unreadable.

    Raises:
        TransferError / VolumeError: it could not be read.
    """
    raw = root.read_bytes(POINTER_NAME)
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def delete_checkpoint(location: Volume) -> None:
    """Delete the checkpoint at ``location``: its ``.metadata`` first (a crash midway leaves an
    unpublished location, never a published one with missing files), then every file there, those
    in spread prefixes included, then the emptied directories.

    Raises:
        TransferError: a delete failed (what was deleted stays deleted).
    """
    location.delete(METADATA_NAME)
    names = [name for name, size in checkpoint_files(location).items() if size >= 0]
    for name in names:
        location.delete(name)
    remove_empty_spread_dirs(location, names)
    location.remove_if_empty()


__all__ = [
    "POINTER_NAME",
    "delete_checkpoint",
    "read_pointer",
    "write_pointer",
    "CHECKS",
    "STATES",
    "CheckpointInfo",
    "Retry",
    "call_once",
    "file_problems",
    "inspect_step",
    "is_published",
    "latest",
    "list_step_entries",
    "list_steps",
    "missing_or_short",
    "open_root",
    "references_of",
    "scan",
]
