"""The checkpoint location's side of a save: claim it, check it, publish ``.metadata``, tidy up.

A save at one location goes through these steps (the writer calls them; none needs DCP types, so
each can be tested on any :class:`~uc_checkpoint.volumes.Volume`):

1. :func:`begin_save` (before any data file exists): refuse a location that holds foreign files or,
   without ``overwrite``, a published checkpoint; abort multipart uploads a killed save left; write
   this save's :class:`SaveMarker`, then the location's claim (:class:`Claim`).
2. After every rank uploaded: :func:`check_claim`, the claim is still this save's (no other save
   started here meanwhile; the claim is the one judge of that, so two saves always agree); and,
   unless the volume vouches for uploads (``Volume.verifies_uploads``: S3) that this process made
   itself (one writer: one rank, or a rank-local save), :func:`check_data_files` on a listing:
   every data file is there with its size. A single writer on S3 verified each upload by its own
   answer (or a HEAD), so no listing runs between its last upload and the publish.
3. :func:`read_published` then :func:`publish_metadata`: the ``.metadata`` there is still the one
   seen at step 1; the new one is published in one atomic write and read back.
4. :func:`remove_superseded`: the replaced checkpoint's data files go, best effort.

The marker protocol (names, and which of two concurrent saves publishes) is described in
:mod:`uc_checkpoint.format.layout`. The read-back in step 3 exists because some FUSE mounts report a rename
or a write as done and lose it; deleting in step 4 after such a loss would lose both checkpoints.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from uc_checkpoint.errors import (
    CheckpointExistsError,
    ConcurrentSaveError,
    LandedSizeError,
    LocationNotEmptyError,
    TransferError,
)
from uc_checkpoint.format import layout
from uc_checkpoint.volumes import Volume

logger = logging.getLogger(__name__)

#: Incomplete multipart uploads younger than this (seconds) may belong to a save still running.
LIVE_UPLOAD_S = 3600.0

#: Reads the manifest (see :mod:`uc_checkpoint.format.layout`) out of a published ``.metadata``'s bytes:
#: None for a checkpoint without one; may raise anything for bytes it cannot decode. It is passed
#: in because decoding ``.metadata`` needs DCP's types, which this module does without.
ManifestReader = Callable[[bytes], Mapping[str, Any] | None]


@dataclass(frozen=True)
class SaveMarker:
    """The marker one save keeps at its location while it runs (see :mod:`uc_checkpoint.format.layout`).

    Attributes:
        rank: the rank of a rank-local save (DCP without collectives), else None.
        token: the save's random token (8 to 32 hex digits), also in its data files' names.
    """

    rank: int | None
    token: str

    def name(self) -> str:
        """The marker's file name: ``.uc-save-<token>`` or ``__<rank>.uc-save-<token>``."""
        return layout.save_marker_name(self.token, self.rank)

    def metadata_name(self) -> str:
        """The ``.metadata`` this save publishes (``__<rank>.metadata`` for a rank-local save)."""
        return layout.metadata_name(self.rank)

    @classmethod
    def parse(cls, name: str) -> SaveMarker | None:
        """The marker a file name stands for, or None for any other file."""
        parsed = layout.parse_save_marker(name)
        return None if parsed is None else cls(*parsed)

    def body(self, save_id: str) -> bytes:
        """The marker's (and the claim's) content: a few bytes of JSON (token, save id, host, pid,
        start time)."""
        return json.dumps(
            {
                "token": self.token,
                "save_id": save_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": time.time(),
            }
        ).encode()

    def write(self, volume: Volume, save_id: str, body: bytes | None = None) -> None:
        """Put the marker on ``volume``: ``body``, by default :meth:`body`.

        The name carries this save's random token, so a plain PUT cannot clobber another marker
        (a conditional one would fail on S3-compatible stores without If-None-Match support)."""
        volume.publish_bytes(self.name(), body if body is not None else self.body(save_id), overwrite=True)

    def remove(self, volume: Volume) -> None:
        """Delete the marker; best effort: a leftover marker is harmless and gc removes it."""
        try:
            volume.delete(self.name())
        except Exception as exc:  # noqa: BLE001 - see the docstring
            logger.warning("could not delete the save marker %s: %s", volume.url_of(self.name()), exc)


@dataclass(frozen=True)
class Claim:
    """What :func:`begin_save` found and wrote at a location.

    Attributes:
        published: the :func:`digest` of the ``.metadata`` published there when the save began
            (``""`` for none).
        tag: the store's version tag (S3: ETag) of the claim this save wrote, None where the
            volume has none (then :func:`check_claim` reads the claim back).
        abandoned: whether a rollback's abandonment marker was there (it annotates the checkpoint
            being replaced and goes with it).
        previous: the bytes of the claim an earlier save left there (None: there was none). Reading
            exactly these back in :func:`check_claim` means the volume did not keep this save's
            write, not that another save claimed the location: every save's claim body is its own.
    """

    published: str
    tag: str | None = None
    abandoned: bool = False
    previous: bytes | None = None


def digest(raw: bytes | None) -> str:
    """sha256 (hex) of a ``.metadata``'s bytes; ``""`` for none."""
    return "" if raw is None else hashlib.sha256(raw).hexdigest()


def begin_save(
    volume: Volume,
    marker: SaveMarker,
    save_id: str,
    *,
    overwrite: bool,
    create_parents: bool,
    on_marked: Callable[[], object] | None = None,
) -> Claim:
    """Claim ``volume`` for a save: one listing, the marker's PUT, then the claim's PUT (and a GET
    of a published ``.metadata`` being replaced).

    The save's data files may be uploaded once the marker is on the volume: ``on_marked`` is
    called then, before the rest (a killed save's files must come with its marker, so that gc and
    the next save know whose they are; the claim itself is checked only before publishing, by
    :func:`check_claim`). On an object store this takes the claim's PUT, tens of ms, out of the
    time before the first upload.

    Returns the :class:`Claim`: the :func:`digest` of the save's ``.metadata``
    (``marker.metadata_name()``) published there now, for :func:`read_published` to tell whether
    another save published meanwhile, the claim's tag and the claim it replaced (one more GET, only
    at a location saved before) for :func:`check_claim`.

    Raises:
        VolumeError: from ``prepare_for_write`` (the location is a file, unwritable, ...).
        LocationNotEmptyError: the location holds files that are not part of a checkpoint.
        CheckpointExistsError: ``overwrite=False`` and a checkpoint is published there.
    """
    volume.prepare_for_write(create_parents=create_parents)
    files = volume.list_files()
    # Spread prefixes (sub-locations of data files) are the checkpoint's own; what they hold is not
    # listed here: one listing per save start, whatever the number of prefixes.
    foreign = sorted(name for name in files if not (layout.is_checkpoint_file(name) or layout.is_spread_dir(name)))
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise LocationNotEmptyError(
            f"checkpoint location {volume.url} holds files that are not part of a checkpoint: {shown}"
        )
    metadata_name = marker.metadata_name()
    replacing = metadata_name in files
    if replacing and not overwrite:
        raise CheckpointExistsError(f"{volume.url_of(metadata_name)} exists and overwrite=False")
    body = marker.body(save_id)
    marker.write(volume, save_id, body)
    if on_marked is not None:
        on_marked()
    published = ""
    if replacing:
        logger.info("replacing the checkpoint published at %s", volume.url)
        published = digest(volume.read_bytes(metadata_name))
    # Uploads a killed save left behind (S3 multipart uploads) cost storage and are never
    # completed. A save writes its marker before its first upload and deletes it only after
    # publishing, so a killed save's uploads come with its marker: without one in the listing there
    # is nothing to look for (and no request to send). While another save's marker is there, its
    # uploads may be live: only old ones go (gc takes the rest).
    if any(SaveMarker.parse(name) for name in files):
        # This save's own uploads may have begun (``on_marked``): never abort them, whatever age
        # the store's clock gives them.
        aborted = volume.abort_incomplete_uploads(
            older_than_s=LIVE_UPLOAD_S, keep=lambda name: layout.is_data_file_of(name, marker.token)
        )
        if aborted:
            logger.info("aborted %d incomplete uploads left at %s", aborted, volume.url)
    claim_name = layout.claim_name(marker.rank)
    previous = volume.read_bytes(claim_name) if claim_name in files else None
    tag = volume.write_tagged(claim_name, body)
    return Claim(published, tag, layout.ABANDONED_NAME in files, previous)


_T = TypeVar("_T")


def in_background(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[_T]:
    """Run ``fn`` on a new daemon thread (named for it); its result or exception comes back
    through the future."""
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name=f"uc-{getattr(fn, '__name__', 'save')}", daemon=True).start()
    return future


class BackgroundClaim:
    """One save's :func:`begin_save`, run in the background from its planning step: claiming a
    location is a listing and two PUTs (tens of ms on an object store), which run while DCP
    gathers the plans and the files are serialised. Nothing may be uploaded before the marker is
    there (:meth:`wait_marked`), nothing published before the whole claim held (:meth:`result`).

    Args:
        volume, marker, save_id, overwrite, create_parents: as :func:`begin_save`'s.
    """

    def __init__(
        self, volume: Volume, marker: SaveMarker, save_id: str, *, overwrite: bool, create_parents: bool
    ) -> None:
        marked: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._marked = marked
        self._claim = in_background(
            begin_save,
            volume,
            marker,
            save_id,
            overwrite=overwrite,
            create_parents=create_parents,
            on_marked=lambda: marked.set_result(None),
        )
        # Runs on the claiming thread once it is done: a claim refused before its marker was
        # written hands its error to whoever waits for the marker.
        self._claim.add_done_callback(self._settle_marked)

    def _settle_marked(self, claim: concurrent.futures.Future[Claim]) -> None:
        if self._marked.done():
            return
        error = claim.exception()
        if error is None:
            self._marked.set_result(None)
        else:
            self._marked.set_exception(error)

    def wait_marked(self) -> None:
        """Wait until the marker is on the volume; raises what claiming raised before that."""
        self._marked.result()

    def done(self) -> bool:
        """Whether the claim is over (held or refused)."""
        return self._claim.done()

    def result(self) -> Claim:
        """Wait for the claim; what it found (raises what claiming raised)."""
        return self._claim.result()

    def wait(self) -> None:
        """Wait for the claim to be over, raising nothing."""
        concurrent.futures.wait([self._claim])


def check_data_files(
    volume: Volume, listing: Mapping[str, int] | None, sizes: Mapping[str, int], referenced: Iterable[str]
) -> None:
    """Every data file must be on the volume, whole, before ``.metadata`` exists.

    Args:
        listing: the location's files and sizes (bytes), those in spread prefixes included
            (:func:`uc_checkpoint.engine.listing.checkpoint_files`); None on a volume whose
            uploads were each verified by the store (``Volume.verifies_uploads``), where only the
            upload records are checked.
        sizes: each uploaded file's size in bytes, as its upload recorded it.
        referenced: every file name the new ``.metadata`` points at.

    Raises:
        TransferError: a file has another size on the volume than uploaded (or is missing), or a
            referenced file has no upload record.
    """
    on_volume = listing if listing is not None else sizes  # verified uploads: their own records
    for name, size in sizes.items():
        if on_volume.get(name) != size:
            raise TransferError(
                f"not publishing {volume.url}: {volume.url_of(name)} has {on_volume.get(name)} bytes on the volume, expected {size}"
            )
    for name in set(referenced) - sizes.keys():
        raise TransferError(f"not publishing {volume.url}: no upload record for {name}")


def check_claim(volume: Volume, mine: SaveMarker, claim: Claim) -> None:
    """Raise ConcurrentSaveError unless the location's claim is still the one this save wrote: the
    last save to claim a location is the one that may publish there (see
    :mod:`uc_checkpoint.format.layout`). One HEAD on S3 (the ETag its PUT got back); elsewhere, or
    when the tags differ, the claim is read and its token compared (so a store whose HEAD reports
    another form of the same ETag costs a GET, never a refused save).

    Raises:
        ConcurrentSaveError: another save claimed the location after this one, or the claim is gone.
        TransferError: the claim read back is the one an earlier save left before this save began
            (``claim.previous``): the volume reported this save's write as done and kept the old
            file (seen on FUSE mounts whose rename keeps an existing target), so no other save is
            involved and publishing over such a volume would not be safe.
    """
    name = layout.claim_name(mine.rank)
    if claim.tag is not None and volume.tag_of(name) == claim.tag:
        return
    raw = volume.read_bytes(name)
    try:
        holder = json.loads(raw or b"null")
    except ValueError:
        holder = None
    if isinstance(holder, dict) and holder.get("token") == mine.token:
        return
    if raw is not None and raw == claim.previous:
        raise TransferError(
            f"not publishing {volume.url}: {volume.url_of(name)} was written by this save but reading it "
            f"back gives the claim an earlier save left before this one began ({_writer_of(raw) or 'unreadable'}); "
            "the volume did not keep the write. A mount that reports a rename over an existing file as "
            "done and keeps the old file (seen on rclone mounts) does this; no other save is involved. "
            "Nothing was published or deleted"
        )
    found = "it is gone" if raw is None else f"claimed by {_writer_of(raw) or 'an unreadable writer'}"
    raise ConcurrentSaveError(
        f"not publishing {volume.url}: another save started at this location while this one ran "
        f"({volume.url_of(name)}: {found}); the newer save publishes, this one is abandoned"
    )


def read_published(
    volume: Volume,
    name: str,
    listing: Mapping[str, int] | None,
    expected_digest: str | None,
    read_manifest: ManifestReader,
) -> bytes | None:
    """The ``.metadata`` published as ``name`` now (None for none), checked to be the one
    :func:`begin_save` saw (its digest ``expected_digest``; None: not checked). ``listing``: the
    location's files when listed (``name`` is read only if there); None: a size lookup (a HEAD on
    S3) tells whether to read it.

    Raises:
        ConcurrentSaveError: another save published ``name`` (or deleted it) while this one ran.
    """
    # Unlisted (S3): a HEAD first, so that the usual case (nothing published there) reads no body.
    there = name in listing if listing is not None else volume.size(name) is not None
    current = volume.read_bytes(name) if there else None
    if expected_digest is not None and digest(current) != expected_digest:
        raise ConcurrentSaveError(
            f"not publishing {volume.url}: another save published {volume.url_of(name)} while "
            f"this one ran ({describe_publisher(current, read_manifest)}); that checkpoint "
            "is kept and this save is abandoned"
        )
    return current


def publish_metadata(
    volume: Volume,
    name: str,
    blob: bytes,
    *,
    overwrite: bool,
    read_manifest: ManifestReader,
    replaced: bytes | None = None,
) -> None:
    """Publish ``blob`` as ``name`` in one atomic write, then read it back unless the store's answer
    to the write already proved the bytes (an object store's CRC-32 or MD5 ETag, see
    :meth:`Volume.publish_bytes`).

    The read-back compares content, not size: some mounts report a rename or a write as done and
    lose it, and the replaced ``.metadata`` may have exactly the new one's size. Deleting the old
    checkpoint's files after such a loss would lose both checkpoints, so the caller deletes nothing
    unless this returns.

    ``replaced``: the ``.metadata`` this publish replaces (None: none was there). Reading that
    back means the write was lost; reading a third save's means that save published right after.

    An "already exists" answer (``overwrite=False``) is classified by reading ``name`` back: this
    save's own bytes there mean the write succeeded (its first answer was lost and the retry found
    it); so does a failed write whose bytes are there whole.

    Raises:
        CheckpointExistsError: ``overwrite=False`` and another save's ``name`` exists.
        ConcurrentSaveError: reading it back gives another save's ``.metadata``, not the replaced
            one: that save published over this one right after it (its manifest names another save
            id).
        TransferError: the write failed, or reading it back gives other bytes or none.
    """
    try:
        proved = volume.publish_bytes(name, blob, overwrite=overwrite)
    except LandedSizeError:
        proved = False  # told apart below, by what is there now
    except CheckpointExistsError:
        # "Already exists" may answer this save's own write: a retry of a conditional PUT whose
        # first answer was lost (S3's 412 to botocore's retry), or link() reporting EEXIST for a
        # retransmitted request (NFS). Only another save's file there is a refusal.
        _refuse_unless_mine(volume, name, blob, read_manifest)
        return
    except TransferError as exc:
        # The write may have reached the store before its answer was lost for good: a publish that
        # took place must not be reported as failed, or a retry of the job meets its checkpoint.
        whole = _landed_as(volume, name, blob)
        if whole:
            logger.warning(
                "publishing %s reported a failure, but it is on the volume whole: %s", volume.url_of(name), exc
            )
            return
        if whole is None:
            raise TransferError(
                f"{exc}; reading {volume.url_of(name)} back failed as well, so this publish may have landed: "
                "look before retrying (`uc-checkpoint ls`; a checkpoint there loads, and a retry with "
                "overwrite=False would be refused by it)"
            ) from exc
        raise
    if proved:
        return
    landed = volume.read_bytes(name)
    if (
        landed is not None
        and landed != blob
        and landed != replaced
        and _save_id(landed, read_manifest) not in (None, _save_id(blob, read_manifest))
    ):
        raise ConcurrentSaveError(
            f"not published: another save published {volume.url_of(name)} right after this one wrote it "
            f"({describe_publisher(landed, read_manifest)}); the later save's checkpoint stands, this one is "
            "abandoned. Nothing was deleted by this save"
        )
    if landed != blob:
        found = (
            "nothing"
            if landed is None
            else f"{len(landed)} bytes of other content ({describe_publisher(landed, read_manifest)})"
        )
        raise TransferError(
            f"not published: {volume.url_of(name)} was written ({len(blob)} bytes) but reading it back "
            f"gives {found}; the volume lost the write. Nothing was deleted: the checkpoint that was "
            "there (if any) and this save's data files are kept"
        )


def _landed_as(volume: Volume, name: str, blob: bytes) -> bool | None:
    """Whether ``name`` holds exactly ``blob`` now; None when it cannot be read (the store is still
    failing: the caller reports the write's own failure, saying the write may have landed)."""
    try:
        return volume.read_bytes(name) == blob
    except Exception:  # noqa: BLE001 - any read failure leaves the answer unknown
        return None


def _refuse_unless_mine(volume: Volume, name: str, blob: bytes, read_manifest: ManifestReader) -> None:
    """Classify an "already exists" answer to publishing ``blob`` as ``name``: return when the file
    there is this save's own (the same bytes, or a ``.metadata`` of the same save id), else raise.

    Raises:
        CheckpointExistsError: another save's file is there (its publisher named) or it is gone.
        TransferError: it could not be read back.
    """
    landed = volume.read_bytes(name)
    mine = _save_id(blob, read_manifest)
    if landed is not None and (landed == blob or (mine is not None and _save_id(landed, read_manifest) == mine)):
        logger.info("%s already held this save's own write (a retried request): published", volume.url_of(name))
        return
    raise CheckpointExistsError(
        f"{volume.url_of(name)} already exists and overwrite=False: another save published it while this "
        f"one ran ({describe_publisher(landed, read_manifest)}); that checkpoint is kept, this save is abandoned"
    )


def remove_superseded(volume: Volume, names: Iterable[str]) -> None:
    """Delete the data files of the checkpoint a save replaced, and only those (in name order).

    Files no published ``.metadata`` references are not passed here: they may belong to another
    job's save in progress at this location (deleting them could leave that save publishing over
    missing files), or to a save that crashed; ``uc-checkpoint gc`` removes them once they are
    older than its grace period. Best effort: a failure is logged, never raised.

    Names in spread prefixes (``3a/__5_...distcp``) are deleted like any other; the prefixes
    themselves stay (the new save's files are usually in the same ones; on object stores there is
    nothing to remove), and gc or retention removes them once empty."""
    for name in sorted(names):
        try:
            volume.delete(name)
        except Exception as exc:  # noqa: BLE001 - cleanup must not fail a published save
            logger.warning("could not delete superseded file %s: %s", volume.url_of(name), exc)


def _utc(seconds: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(seconds)))


def _writer_of(raw: bytes | None) -> str | None:
    """Who wrote a marker's or claim's JSON (:meth:`SaveMarker.body`), in words; None when it
    cannot be told."""
    try:
        info = json.loads(raw or b"{}")
        return f"host {info['host']}, pid {info['pid']}, started {_utc(info['started'])}"
    except Exception:  # noqa: BLE001 - gone, written by something else, or damaged
        return None


def _save_id(raw: bytes, read_manifest: ManifestReader) -> str | None:
    """The save id a ``.metadata``'s manifest records (None: none, or not readable)."""
    try:
        save_id = (read_manifest(raw) or {}).get("save_id")
    except Exception:  # noqa: BLE001 - written by another writer or unreadable
        return None
    return save_id if isinstance(save_id, str) and save_id else None


def describe_publisher(raw: bytes | None, read_manifest: ManifestReader) -> str:
    """Which process published a ``.metadata`` (its bytes ``raw``; None: gone), in words."""
    if raw is None:
        return "and it has since been deleted"
    try:
        manifest = read_manifest(raw) or {}
        by = manifest.get("saved_by") or {}
        return f"save {manifest.get('save_id')}: host {by['host']}, pid {by['pid']}, published {_utc(by['time'])}"
    except Exception:  # noqa: BLE001 - written by another writer or unreadable: say so
        return "by a writer that did not record itself"


__all__ = [
    "BackgroundClaim",
    "in_background",
    "LIVE_UPLOAD_S",
    "Claim",
    "ManifestReader",
    "SaveMarker",
    "begin_save",
    "check_claim",
    "check_data_files",
    "describe_publisher",
    "digest",
    "publish_metadata",
    "read_published",
    "remove_superseded",
]
