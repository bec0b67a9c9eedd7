"""Garbage collection of what crashed or failed saves leave behind.

A save that dies leaves data files without a ``.metadata`` (or, at a location that already held a
published checkpoint, data files the published ``.metadata`` does not reference), S3 multipart
uploads that were never completed (their parts are billed until aborted), and staging directories on
the local disk. None of this is ever visible to a reader (no ``.metadata`` points at it); it only
costs space. :func:`collect_garbage` removes it once it is older than a grace period, so that a save
still in progress, whose files are recent, is never touched.

Also available as ``uc-checkpoint gc ROOT [--grace-s S] [--dry-run]``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from uc_checkpoint.dcp.metadata_io import data_file_names, read_metadata
from uc_checkpoint.engine.listing import checkpoint_entries, remove_empty_spread_dirs
from uc_checkpoint.engine.staging_dir import default_staging_root
from uc_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from uc_checkpoint.format.layout import ABANDONED_NAME, METADATA_NAME, is_checkpoint_file, is_claim
from uc_checkpoint.ops.catalog import list_steps, open_root
from uc_checkpoint.volumes import Volume

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


def _collect_location(
    location: Volume, published: bool | None, cutoff: float, report: GCReport, remove_empty: bool = True
) -> None:
    # Only names a save produces are ever candidates: a user's own files stay, whatever their age.
    entries = checkpoint_entries(location)  # sizes and times: one listing, and one per spread prefix
    sizes = {e.name: e.size for e in entries if e.size >= 0 and is_checkpoint_file(e.name)}
    mtimes = {e.name: e.mtime for e in entries if not e.is_dir and e.mtime is not None}
    if published is None:  # not looked up by the caller: the listing shows it
        published = METADATA_NAME in sizes
    if published:
        try:
            metadata = read_metadata(location)
        except CorruptCheckpointError as exc:
            # Unreadable metadata: we cannot tell which files it needs. Leave all of it for a human.
            logger.warning("gc: leaving %s alone: %s", location.url, exc)
            report.spared_locations.append(location.url)
            return
        except CheckpointNotFoundError:
            # Unpublished since it was listed (retention, or a re-save on a mount that cannot
            # replace files): its files are in motion; the next run sees what became of them.
            logger.info("gc: leaving %s alone: its %s disappeared while collecting", location.url, METADATA_NAME)
            report.spared_locations.append(location.url)
            return
        needed = data_file_names(metadata)
        # A rollback's marker belongs to the published checkpoint (uc_checkpoint.ops.lineage), and
        # the claim to the location (the next save's check reads it; format.layout).
        candidates = {
            n for n in sizes if n not in (METADATA_NAME, ABANDONED_NAME) and not is_claim(n) and n not in needed
        }
    else:
        candidates = set(sizes)
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


def _collect_staging(staging_root: Path, cutoff: float, report: GCReport) -> None:
    base = staging_root / "uc-checkpoint"
    try:
        entries = list(os.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
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
    * with ``include_staging``: staging directories on this host (under ``staging_dir`` or the
      default staging root) whose newest file is older than ``grace_s``.

    Never deletes a ``.metadata``, a file it references, or a file whose name no save produces. Run it on one process (rank 0 or a
    cron job). Returns a :class:`GCReport`.

    A store error (a listing, a ``HEAD`` or a ``.metadata`` read that fails after the client's
    retries) stops the collection with that error before anything more is deleted: what a location
    needs is never guessed from a store that did not answer.

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
    root_files = volume.list_files()
    if any(is_checkpoint_file(n) for n in root_files):
        # The root is itself one checkpoint location (not a manager root of step_* locations).
        _collect_location(volume, METADATA_NAME in root_files, cutoff, report, remove_empty=False)
        if not dry_run:
            report.aborted_uploads += volume.abort_incomplete_uploads(older_than_s=grace_s)
    for info in list_steps(volume, published=False):  # each location's own listing says the rest
        location = volume.child(info.name)
        _collect_location(location, info.published, cutoff, report)
        if not dry_run:
            report.aborted_uploads += location.abort_incomplete_uploads(older_than_s=grace_s)
    if include_staging:
        _collect_staging(Path(staging_dir) if staging_dir is not None else default_staging_root(), cutoff, report)
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
