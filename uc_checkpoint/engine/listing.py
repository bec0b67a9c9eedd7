"""Listing one checkpoint location, spread prefixes included.

A save that spreads its data files over key prefixes (:func:`uc_checkpoint.format.layout.spread_dir`)
puts them one level below the location, in sub-locations named by one or two hex digits. The
volumes list one level (:meth:`~uc_checkpoint.volumes.Volume.list_entries`); this module lists the
location, then each spread prefix the listing shows, once, through the volume's
:meth:`~uc_checkpoint.volumes.Volume.child`, and names what it finds there ``<spread>/<name>``. A
checkpoint without spread prefixes costs the one listing it always did; one with N costs N + 1,
sent a few at a time.

Everything that checks or deletes a checkpoint's files (the publish-time check, retention, ``ls``,
``verify``, ``gc``) lists through here, so none of them misses the files in spread prefixes.

:func:`locations_below` gives the same entries for every checkpoint location under a root at once,
from one recursive listing of the root (:meth:`~uc_checkpoint.volumes.Volume.list_tree`): what
``CheckpointManager.list()``, ``uc-checkpoint ls`` and ``gc`` read, so that their listing costs
the root's keys divided by a page (S3: 1,000 keys a request), not a request per checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from uc_checkpoint.format import layout
from uc_checkpoint.volumes import Entry, Volume
from uc_checkpoint.volumes.workers import Workers

logger = logging.getLogger(__name__)

#: Spread prefixes listed at once (each listing is one request, or one per 1,000 keys on S3).
LISTING_THREADS = 8
#: Locations whose ``.metadata`` is read at once by :func:`in_parallel`'s callers (``ls --check all``,
#: ``gc``): a small ``.metadata`` costs a request's latency, not bandwidth, so a few in flight
#: divide the time by as many.
READ_THREADS = 8

T = TypeVar("T")
R = TypeVar("R")


def checkpoint_entries(volume: Volume) -> list[Entry]:
    """Every entry of the checkpoint location ``volume``, with the files of its spread prefixes
    in place of the prefixes themselves (named ``<spread>/<name>``, with their sizes and times).
    Other sub-locations are listed as they are (names ending in ``/``, size ``-1``); ``[]`` for a
    location that does not exist.

    Requests: one listing of the location, plus one per spread prefix it holds.

    Raises:
        VolumeError / TransferError: a listing failed (see :meth:`Volume.list_entries`).
    """
    top = volume.list_entries()
    spread = sorted(e.name for e in top if layout.is_spread_dir(e.name))
    out = [e for e in top if not layout.is_spread_dir(e.name)]
    if not spread:
        return out
    if len(spread) == 1:
        listings = [_below(volume, spread[0])]
    else:
        with Workers(min(LISTING_THREADS, len(spread)), thread_name_prefix="uc-list") as pool:
            listings = list(pool.map(lambda d: _below(volume, d), spread))
    for found in listings:
        out.extend(found)
    return out


def _below(volume: Volume, spread: str) -> list[Entry]:
    """The entries of one spread prefix (``spread`` ends with ``/``), named relative to ``volume``."""
    return [Entry(spread + e.name, e.size, e.mtime) for e in volume.child(spread.rstrip("/")).list_entries()]


def checkpoint_files(volume: Volume) -> dict[str, int]:
    """Names and sizes (bytes) of :func:`checkpoint_entries` (sub-locations with size ``-1``).

    Raises:
        VolumeError / TransferError: as :func:`checkpoint_entries`.
    """
    return {e.name: e.size for e in checkpoint_entries(volume)}


def locations_below(root: Volume, prefix: str) -> dict[str, list[Entry]]:
    """The entries of every sub-location of ``root`` whose name starts with ``prefix`` (``"step_"``:
    the checkpoint locations of a manager's root), by location name (no trailing ``/``), each list
    as :func:`checkpoint_entries` gives it for that location: its files, the files of its spread
    prefixes as ``<spread>/<name>``, other sub-locations as names ending in ``/`` (size ``-1``).
    Files directly at the root are left out. A location that holds nothing is listed (``[]``) on
    stores with directories; an object store has no empty locations.

    Requests: one :meth:`~uc_checkpoint.volumes.Volume.list_tree` of the root: on S3 one per 1,000
    keys below ``<root>/<prefix>``; elsewhere a walk (one listing per directory).

    Raises:
        VolumeError / TransferError: the listing failed (see :meth:`Volume.list_tree`).
    """
    found: dict[str, dict[str, Entry]] = {}
    for entry in root.list_tree(prefix):
        location, sep, rest = entry.name.partition("/")
        if not sep:
            continue  # a file directly at the root
        entries = found.setdefault(location, {})
        head, sep, below = rest.partition("/")
        if not sep:
            if rest:
                entries[rest] = Entry(rest, entry.size, entry.mtime)  # a file of the location itself
            continue
        if not layout.is_spread_dir(head + "/"):
            entries.setdefault(head + "/", Entry(head + "/", -1))  # another sub-location: as one entry
            continue
        # In a spread prefix: its files, and its own sub-locations one level down (as one listing
        # of the prefix reports them).
        name, sep, _ = below.partition("/")
        if sep:
            entries.setdefault(f"{head}/{name}/", Entry(f"{head}/{name}/", -1))
        elif name:
            entries[rest] = Entry(rest, entry.size, entry.mtime)
    return {location: list(entries.values()) for location, entries in found.items()}


def in_parallel(fn: Callable[[T], R], items: Sequence[T], threads: int = READ_THREADS) -> list[R]:
    """``[fn(item) for item in items]``, on up to ``threads`` threads (one call per location is
    one request or a few: they wait on the store, not on the CPU).

    Raises:
        The first error of a call, in ``items``' order, once the calls not started yet are
        cancelled and those running have returned.
    """
    if len(items) <= 1 or threads <= 1:
        return [fn(item) for item in items]
    pool = Workers(min(threads, len(items)), thread_name_prefix="uc-read")
    try:
        futures = [pool.submit(fn, item) for item in items]
        return [fut.result() for fut in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def remove_empty_spread_dirs(volume: Volume, names: Iterable[str]) -> None:
    """Remove the spread prefixes of ``names`` (file names relative to ``volume``) that are now
    empty directories (stores with real directories; object stores have nothing to remove). A
    prefix that still holds files, or cannot be removed, stays; nothing is raised."""
    for spread in sorted({layout.split_spread(name)[0] for name in names} - {""}):
        try:
            volume.child(spread).remove_if_empty()
        except Exception as exc:  # noqa: BLE001 - tidying up must not fail what deleted the files
            logger.debug("could not remove %s: %s", volume.url_of(spread), exc)


__all__ = [
    "LISTING_THREADS",
    "READ_THREADS",
    "checkpoint_entries",
    "checkpoint_files",
    "in_parallel",
    "locations_below",
    "remove_empty_spread_dirs",
]
