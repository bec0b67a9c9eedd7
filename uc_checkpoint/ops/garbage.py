"""Garbage collection of what crashed or failed saves leave behind.

A save that dies leaves data files without a ``.metadata`` (or, at a location that already held a
published checkpoint, data files the published ``.metadata`` does not reference), S3 multipart
uploads that were never completed (their parts are billed until aborted), and staging directories on
the local disk. None of this is ever visible to a reader (no ``.metadata`` points at it); it only
costs space. :func:`collect_garbage` removes it once it is older than a grace period, so that a save
still in progress, whose files are recent, is never touched.

Also available as ``uc-checkpoint gc ROOT [--grace-s S] [--dry-run]``.

What a published checkpoint references is known only from its ``.metadata``, so ``gc`` reads every
one (a few at a time); the rest comes from one recursive listing of the root and one listing of
its multipart uploads, not from a request per checkpoint (docs/operating.md counts them).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from uc_checkpoint.engine.listing import checkpoint_entries, in_parallel, remove_empty_spread_dirs
from uc_checkpoint.engine.staging_dir import (
    LOCK_SUFFIX,
    OWNER_SUFFIX,
    owned_on_this_host,
    reclaim_dead_staging,
    user_staging_base,
)
from uc_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from uc_checkpoint.format.layout import ABANDONED_NAME, METADATA_NAME, is_checkpoint_file, is_claim, step_of
from uc_checkpoint.ops.catalog import list_step_entries, open_root
from uc_checkpoint.volumes import Entry, Volume

logger = logging.getLogger(__name__)

#: Default grace period: files younger than this (seconds) are never collected.
DEFAULT_GRACE_S = 6 * 3600.0


@dataclass
class GCReport:
    """What :func:`collect_garbage` removed (or, with ``dry_run``, would remove).

    Attributes:
        deleted_files: full paths/URLs of deleted data files.
        deleted_bytes: their total size in bytes.
        aborted_uploads: incomplete multipart uploads aborted.
        removed_staging_dirs: local staging directories removed.
        spared_locations: step locations left alone because a file there is younger than the grace
            period (a save may be in progress) or because their ``.metadata`` cannot be read.
    """

    deleted_files: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    aborted_uploads: int = 0
    removed_staging_dirs: list[str] = field(default_factory=list)
    spared_locations: list[str] = field(default_factory=list)
    dry_run: bool = False


def _never_needed(name: str) -> bool:
    """Whether ``name`` is a file a save writes (``is_checkpoint_file``) that no ``.metadata`` can
    need: candidates of a published location are these, less what its ``.metadata`` references.
    A rollback's marker belongs to the published checkpoint (uc_checkpoint.ops.lineage), and the
    claim to the location (the next save's check reads it; format.layout)."""
    return is_checkpoint_file(name) and name not in (METADATA_NAME, ABANDONED_NAME) and not is_claim(name)


def _needed(location: Volume) -> set[str] | CorruptCheckpointError | CheckpointNotFoundError:
    """The data files the published ``.metadata`` at ``location`` references (one GET), or why it
    cannot say: undecodable, or gone since the listing. Only the names are kept, not the metadata.

    Raises:
        TransferError / VolumeError: the store failed to return it.
    """
    from uc_checkpoint.dcp.metadata_io import data_file_names, read_metadata  # needs torch

    try:
        return data_file_names(read_metadata(location))
    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
        return exc


def _collect_location(
    location: Volume,
    entries: list[Entry],
    needed: set[str] | CorruptCheckpointError | CheckpointNotFoundError | None,
    cutoff: float,
    report: GCReport,
    remove_empty: bool = True,
) -> None:
    """Collect one location from its listing (``entries``: sizes and times, spread prefixes
    included) and, for a published one, what its ``.metadata`` references (``needed``: see
    :func:`_needed`; None for an unpublished location)."""
    # Only names a save produces are ever candidates: a user's own files stay, whatever their age.
    sizes = {e.name: e.size for e in entries if e.size >= 0 and is_checkpoint_file(e.name)}
    mtimes = {e.name: e.mtime for e in entries if not e.is_dir and e.mtime is not None}
    if isinstance(needed, CorruptCheckpointError):
        # Unreadable metadata: we cannot tell which files it needs. Leave all of it for a human.
        logger.warning("gc: leaving %s alone: %s", location.url, needed)
        report.spared_locations.append(location.url)
        return
    if isinstance(needed, CheckpointNotFoundError):
        # Unpublished since it was listed (retention, or a re-save on a mount that cannot
        # replace files): its files are in motion; the next run sees what became of them.
        logger.info("gc: leaving %s alone: its %s disappeared while collecting", location.url, METADATA_NAME)
        report.spared_locations.append(location.url)
        return
    published = needed is not None
    candidates = set(sizes) if needed is None else {n for n in sizes if _never_needed(n) and n not in needed}
    if not candidates:
        return
    # A save in progress writes the candidates (it is what produces unreferenced files): spare the
    # location unless every candidate is old. A store without times spares everything.
    if any(mtimes.get(n, float("inf")) > cutoff for n in candidates):
        report.spared_locations.append(location.url)
        return
    for name in sorted(candidates):
        report.deleted_files.append(location.url_of(name))
        report.deleted_bytes += sizes[name]
        if not report.dry_run:
            location.delete(name)
    if not report.dry_run:
        remove_empty_spread_dirs(location, candidates)
    if not published and not report.dry_run and remove_empty:
        location.remove_if_empty()


def _upload_covered(name: str, root_is_location: bool) -> bool:
    """Whether gc aborts an upload of ``name`` (relative to the root): a file of a step location
    (directly in it, or a data file in one of its spread prefixes), or of the root itself when it
    is one checkpoint location."""
    top, sep, rest = name.partition("/")
    if sep and step_of(top) is not None:
        return "/" not in rest or is_checkpoint_file(rest)
    return root_is_location and ("/" not in name or is_checkpoint_file(name))


def _collect_staging(base: Path, cutoff: float, report: GCReport) -> None:
    """This user's staging directories under ``base``: those of dead processes of this host at once
    (whatever their age), those of live ones never, the rest (no owner record, or another host's)
    once their newest file is older than ``cutoff``."""
    reclaimed = reclaim_dead_staging(base, dry_run=report.dry_run)
    report.removed_staging_dirs += [str(r.path) for r in reclaimed]
    gone = {r.path.name for r in reclaimed}
    try:
        entries = list(os.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.name in gone or not entry.is_dir(follow_symlinks=False) or owned_on_this_host(Path(entry.path)):
            continue
        newest = entry.stat(follow_symlinks=False).st_mtime
        for dirpath, dirnames, filenames in os.walk(entry.path):
            for name in dirnames + filenames:
                try:
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
                except FileNotFoundError:
                    continue
        if newest > cutoff:
            continue  # a save or load on this host may still be using it
        report.removed_staging_dirs.append(entry.path)
        if not report.dry_run:
            shutil.rmtree(entry.path, ignore_errors=True)
            for suffix in (OWNER_SUFFIX, LOCK_SUFFIX):
                Path(entry.path + suffix).unlink(missing_ok=True)


def collect_garbage(
    root: str | Volume,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    staging_dir: str | os.PathLike[str] | None = None,
    include_staging: bool = True,
    dry_run: bool = False,
) -> GCReport:
    """Remove leftovers of failed saves under the checkpoint ``root`` (its ``step_*`` locations, or
    ``root`` itself when it is one checkpoint location).

    * unpublished locations (no ``.metadata``) whose files are all older than ``grace_s``
      seconds: every file, then the location;
    * published locations: files the ``.metadata`` does not reference (a failed re-save at the same
      location), when all of them are older than ``grace_s``; the checkpoint itself is untouched;
    * incomplete multipart uploads at the locations, started more than ``grace_s`` ago;
    * with ``include_staging``: this user's staging directories under ``staging_dir`` (or the
      default staging root): at once those whose owner process on this host is gone
      (:func:`~uc_checkpoint.engine.staging_dir.reclaim_dead_staging`), never those of a live
      one, and the others (no owner record, or another host's) once their newest file is older
      than ``grace_s``.

    Never deletes a ``.metadata``, a file it references, or a file whose name no save produces. Run it on one process (rank 0 or a
    cron job). Returns a :class:`GCReport`.

    A store error (a listing or a ``.metadata`` read that fails after the client's retries) stops
    the collection with that error before anything is deleted: what a location needs is never
    guessed from a store that did not answer.

    Requests: a listing of the root itself and one recursive listing of its step locations (on S3
    a request per 1,000 keys), a GET of each published ``.metadata`` (``READ_THREADS`` at a time),
    one listing of the root's incomplete multipart uploads (none with ``dry_run``), and a request
    per file deleted or upload aborted.

    Raises:
        ValueError: ``grace_s`` is negative.
        VolumeError: a local root is missing or not a directory.
        VolumeError / TransferError: the root, a location or a ``.metadata`` cannot be read; the
            message names it.
    """
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    volume = open_root(root, what="gc root", missing="is not a directory (it does not exist)")
    cutoff = time.time() - grace_s
    report = GCReport(dry_run=dry_run)
    # Everything is listed and every .metadata read before the first delete.
    root_files = volume.list_files()
    is_location = any(is_checkpoint_file(n) for n in root_files)
    todo: list[tuple[Volume, list[Entry], bool]] = []
    if is_location:
        # The root is itself one checkpoint location (not a manager root of step_* locations).
        todo.append((volume, checkpoint_entries(volume), METADATA_NAME in root_files))
    todo += [(volume.child(info.name), entries, bool(info.published)) for info, entries in list_step_entries(volume)]
    published = [location for location, _entries, is_published in todo if is_published]
    needed = dict(zip([location.url for location in published], in_parallel(_needed, published), strict=True))
    for location, entries, is_published in todo:
        what = needed[location.url] if is_published else None
        _collect_location(location, entries, what, cutoff, report, remove_empty=location is not volume)
    if not dry_run:
        # One listing of the uploads under the root: those at its step locations (and at the root
        # when it is a location itself).
        report.aborted_uploads += volume.abort_incomplete_uploads(
            older_than_s=grace_s, within=lambda name: _upload_covered(name, is_location)
        )
    if include_staging:
        _collect_staging(user_staging_base(staging_dir), cutoff, report)
    logger.info(
        "gc %s: %s %d files (%d bytes), aborted %d uploads, %d staging dirs; spared %d locations",
        volume.url,
        "would delete" if dry_run else "deleted",
        len(report.deleted_files),
        report.deleted_bytes,
        report.aborted_uploads,
        len(report.removed_staging_dirs),
        len(report.spared_locations),
    )
    return report


__all__ = ["DEFAULT_GRACE_S", "GCReport", "collect_garbage"]
