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
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from uc_checkpoint.format import layout
from uc_checkpoint.volumes import Entry, Volume

logger = logging.getLogger(__name__)

#: Spread prefixes listed at once (each listing is one request, or one per 1,000 keys on S3).
LISTING_THREADS = 8


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
        with ThreadPoolExecutor(min(LISTING_THREADS, len(spread)), thread_name_prefix="uc-list") as pool:
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


def remove_empty_spread_dirs(volume: Volume, names: Iterable[str]) -> None:
    """Remove the spread prefixes of ``names`` (file names relative to ``volume``) that are now
    empty directories (stores with real directories; object stores have nothing to remove). A
    prefix that still holds files, or cannot be removed, stays; nothing is raised."""
    for spread in sorted({layout.split_spread(name)[0] for name in names} - {""}):
        try:
            volume.child(spread).remove_if_empty()
        except Exception as exc:  # noqa: BLE001 - tidying up must not fail what deleted the files
            logger.debug("could not remove %s: %s", volume.url_of(spread), exc)


__all__ = ["LISTING_THREADS", "checkpoint_entries", "checkpoint_files", "remove_empty_spread_dirs"]
