"""The small interface every volume backend implements.

A :class:`Volume` is a flat namespace of files under one root: a local or FUSE-mounted directory,
an S3 prefix, an fsspec URL, or a dict in memory. The DCP adapters only ever use these calls, so a
backend is one module with one class. The shape follows fsspec's ``AbstractFileSystem`` (one
interface, chosen by URL) cut down to what checkpointing needs, and torchsnapshot's storage plugins
(write, read, delete).

As in fsspec's ``spec.py``, a backend implements a few primitives and the rest is written once here:

- listing: the backend's :meth:`Volume._scan` (one pass over the location, like fsspec's
  ``ls(detail=True)``, with the backend's error mapping) gives :class:`Entry` records, from which
  :meth:`~Volume.list_entries`, :meth:`~Volume.list_files`, :meth:`~Volume.list_mtimes`,
  :meth:`~Volume.exists` and (where the store has no cheaper call) :meth:`~Volume.size` follow;
- copying: :meth:`~Volume.open_write` and :meth:`~Volume.open_read` give
  :meth:`~Volume.upload_file` and :meth:`~Volume.download_file` (the checksummed copy and the size
  checks), unless the backend has a transfer engine of its own (S3: s3transfer);
- wording: :meth:`~Volume._missing` and :meth:`~Volume._truncated` say "missing" and "truncated" the
  same way for every backend.

A backend overrides a derived method only where it can do better (S3 answers :meth:`~Volume.size`
with one HEAD instead of a listing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from uc_checkpoint.errors import CorruptCheckpointError, LandedSizeError, TransferError, UCCheckpointError
from uc_checkpoint.format.integrity import Digest, FileRecord, copy_stream

__all__ = ["Entry", "FileRecord", "FileStat", "Volume"]


@dataclass(frozen=True)
class Entry:
    """One name directly at a location, as one listing reports it (fsspec's ``ls(detail=True)``
    record, cut down).

    Attributes:
        name: the file's name relative to the location; a sub-location's ends with ``/``.
        size: bytes; ``-1`` for a sub-location.
        mtime: last-modified time (Unix seconds), or ``None`` where the store reports none (and for
            sub-locations).
    """

    name: str
    size: int
    mtime: float | None = None

    @property
    def is_dir(self) -> bool:
        """Whether this is a sub-location (a directory, or a common prefix of an object store)."""
        return self.name.endswith("/")


@dataclass(frozen=True)
class FileStat:
    """What the store says of one file without reading it (a ``stat``, an object's HEAD).

    Attributes:
        size: bytes.
        mtime_ns: last-modified time in integer nanoseconds since the Unix epoch, or ``None`` where
            the store reports none.
        etag: the store's version tag of the content (an object's ETag, without its quotes), or
            ``None`` where the store keeps none (local files).
    """

    size: int
    mtime_ns: int | None = None
    etag: str | None = None


class Volume(ABC):
    """A checkpoint location on some store; every name is relative to :attr:`url`.

    Implementations must be picklable and cheap to construct: DCP's PROCESS mode pickles the storage
    writer (and so its volume) into a daemon process. Clients, sessions and pools are created lazily.
    """

    #: The location's canonical URL or path, used in every error message.
    url: str

    #: Whether loads should fetch byte ranges rather than whole files (object stores: yes, a
    #: request costs the same for 1 byte or 1 MiB; a local disk: whole files, streamed).
    prefers_ranged_reads: bool = False

    #: Whether the store limits its request rate per key prefix (S3: about 3,500 writes/s per
    #: prefix before 503 SlowDown), so that a save of very many ranks should spread its data files
    #: over several prefixes (see :func:`uc_checkpoint.format.layout.spread_count`).
    partitions_by_prefix: bool = False

    #: The exceptions of the store's own client that :meth:`upload_file` and :meth:`download_file`
    #: report as :class:`TransferError` (a local disk: ``OSError``; fsspec filesystems raise
    #: anything). Others propagate unchanged: they are bugs, not store failures.
    _store_errors: tuple[type[BaseException], ...] = (OSError,)

    @property
    def retries(self) -> int:
        """Requests retried so far by this volume's client (0 for stores without retries).

        Throttling, 5xx, timeouts, cut bodies: read it before and after a transfer for its count."""
        return 0

    def url_of(self, name: str) -> str:
        """The full URL or path of ``name`` (for messages and logs)."""
        return f"{self.url.rstrip('/')}/{name}"

    @abstractmethod
    def child(self, name: str) -> Volume:
        """The location ``name`` below this one (for example one step's checkpoint under a root)."""

    def with_location(self, location: str) -> Volume | None:
        """``location`` (a path or URL) as a volume of this kind with this volume's settings
        (endpoint, credentials, part sizes; a shared client where it has one), or None when it names
        another kind of store, or when this kind has no settings to carry: the location is then
        opened as given (:func:`~uc_checkpoint.volumes.open_volume`). A storage writer or reader
        built from a volume opens DCP's ``checkpoint_id`` this way, so that the volume's endpoint is
        not dropped for the default one.

        Raises:
            VolumeError: ``location`` is of this kind but not a valid location for it.
        """
        return None

    # ---- checks -------------------------------------------------------------------------------
    @abstractmethod
    def prepare_for_write(self, create_parents: bool = True) -> None:
        """Make sure files can be written here, creating the location if the store needs it.

        Raises:
            VolumeError: the location is a file, its parent does not exist (with
                ``create_parents=False``), or it is not writable. The message names the path.
        """

    # ---- listing: one primitive, the rest derived -----------------------------------------------
    @abstractmethod
    def _scan(self) -> Sequence[Entry] | None:
        """The backend's one listing primitive: every name directly at this location, each with
        what the same listing says of it, or ``None`` when the location does not exist (stores with
        real directories; an object store's empty prefix is an empty list).

        Raises:
            VolumeError: the location is a file, or the store says its container does not exist
                (an S3 bucket); the message names it.
            TransferError: the store failed to answer (never taken for "empty").
        """

    def list_entries(self) -> list[Entry]:
        """Every name directly at this location with its size and time (one listing; ``[]`` if the
        location does not exist).

        Raises:
            VolumeError / TransferError: as :meth:`_scan`.
        """
        return list(self._scan() or ())

    def list_files(self) -> dict[str, int]:
        """Names and sizes (bytes) of the files directly at this location; ``{}`` if it does not
        exist. Sub-locations are listed as names ending in ``/`` with size ``-1``.

        Raises:
            VolumeError / TransferError: as :meth:`_scan`.
        """
        return {entry.name: entry.size for entry in self.list_entries()}

    def list_mtimes(self) -> dict[str, float]:
        """Last-modified time (Unix seconds) of each file directly at this location; ``{}`` if it
        does not exist. Garbage collection uses it to spare files a save may still be writing. A
        store that does not report times returns none, and nothing of it is collected by age.

        Raises:
            VolumeError / TransferError: as :meth:`_scan`.
        """
        return {e.name: e.mtime for e in self.list_entries() if not e.is_dir and e.mtime is not None}

    def list_tree(self, prefix: str = "") -> list[Entry]:
        """Every file below this location, at any depth, whose name relative to it starts with
        ``prefix`` (``step_00000001/3a/__5_0123abcd_0.distcp`` for ``prefix="step_"``), with its
        size and time; on stores with directories also the sub-locations on the way (names ending in
        ``/``, size ``-1``). ``[]`` if the location does not exist. For listings that must not cost a
        request per sub-location (``CheckpointManager.list()``, ``uc-checkpoint ls``, ``gc``).

        Derived: a walk, one listing of this location and one of each sub-location that matches
        (fsspec's ``walk``). Stores whose one listing can return every key below a prefix override
        it (S3: one ``ListObjectsV2`` without delimiter, a request per 1,000 keys).

        Raises:
            VolumeError / TransferError: as :meth:`_scan`.
        """
        out: list[Entry] = []
        pending: list[tuple[str, Volume]] = [("", self)]
        while pending:
            above, volume = pending.pop()
            for entry in volume.list_entries():
                name = above + entry.name
                if name.startswith(prefix):
                    out.append(Entry(name, entry.size, entry.mtime))
                if entry.is_dir and (name.startswith(prefix) or prefix.startswith(name)):
                    pending.append((name, volume.child(entry.name.rstrip("/"))))
        return out

    def exists(self) -> bool:
        """Whether the location is there to hold checkpoints: ``False`` when it is missing, on stores
        that have real directories (a local path). Stores without directories (object stores) have
        no location to be missing: every prefix exists, empty or not.

        Callers that must tell "missing" from "present but empty" (``ls`` and ``gc`` of a root) ask
        this instead of testing the volume's kind.

        Raises:
            VolumeError: the location is a file, not a directory; the message names it.
            TransferError: the store failed to answer.
        """
        return self._scan() is not None

    def size(self, name: str) -> int | None:
        """Size of ``name`` in bytes, or ``None`` if it does not exist (or is a sub-location).

        Derived from one listing; backends with a cheaper call (``stat``, ``HEAD``) override it.

        Raises:
            VolumeError / TransferError: as :meth:`_scan`.
        """
        for entry in self.list_entries():
            if entry.name == name:
                return entry.size
        return None

    def stat(self, name: str) -> FileStat | None:
        """Size, time and version tag of the file ``name``, or ``None`` if it does not exist (or is a
        sub-location). Data readers take a file's version stamp (mtime or ETag) from it.

        Derived from one listing; backends with a cheaper call (``stat``, ``HEAD``) override it.

        Raises:
            VolumeError / TransferError: as :meth:`_scan`.
        """
        for entry in self.list_entries():
            if entry.name == name and not entry.is_dir:
                mtime_ns = None if entry.mtime is None else int(entry.mtime * 1_000_000_000)
                return FileStat(entry.size, mtime_ns)
        return None

    # ---- data movement ------------------------------------------------------------------------
    def open_write(self, name: str, *, sync: bool = True) -> AbstractContextManager[BinaryIO]:
        """Copy primitive: a binary stream that becomes the file ``name`` when the ``with`` block
        ends without an error (durable then, with ``sync``). A backend that keeps the default
        :meth:`upload_file` implements it. ``name`` may be ``<sub>/<file>`` (a data file in a
        spread prefix): the sub-location is created where the store has directories.

        Raises:
            NotImplementedError: the backend overrides :meth:`upload_file` instead (S3).
            The store's errors (:attr:`_store_errors`) as its client raises them.
        """
        raise NotImplementedError(f"{type(self).__name__} has no open_write; it overrides upload_file")

    def open_read(self, name: str) -> AbstractContextManager[tuple[BinaryIO, int]]:
        """Copy primitive: ``name`` opened for reading, with its size in bytes as the store reports
        it. A backend that keeps the default :meth:`download_file` implements it.

        Raises:
            CorruptCheckpointError: ``name`` does not exist (:meth:`_missing`) or is not a regular
                file.
            NotImplementedError: the backend overrides :meth:`download_file` instead (S3).
            The store's errors (:attr:`_store_errors`) as its client raises them.
        """
        raise NotImplementedError(f"{type(self).__name__} has no open_read; it overrides download_file")

    def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
        """Copy a finished local file to ``name``, verify what landed, and return its record
        (size, CRC-32, block CRC-32s; see :mod:`uc_checkpoint.format.integrity`).

        The file is written under its final name (no rename): nobody reads data files before
        ``.metadata`` points at them. With ``sync`` the data is made durable before returning.
        Verification: the size on the volume, and the store's own checksum where it keeps one.

        The default streams ``local_path`` through :meth:`open_write`, checksumming on the way
        (:func:`~uc_checkpoint.format.integrity.copy_stream`), then compares :meth:`size` with the bytes
        sent.

        Raises:
            TransferError: the copy failed or landed with another size or checksum; the message
                names both ends.
        """
        where = self.url_of(name)
        digest = Digest()
        try:
            with open(local_path, "rb") as src, self.open_write(name, sync=sync) as dst:
                copy_stream(src, dst, digest)
        except UCCheckpointError:
            raise
        except self._store_errors as exc:
            raise TransferError(f"uploading {local_path} to {where} failed: {exc}") from exc
        record = digest.record(name)
        landed = self.size(name)
        if landed != record.size:
            raise TransferError(f"{where} landed with {landed} bytes, expected {record.size}")
        return record

    def download_file(
        self, name: str, local_path: Path, *, expected_size: int | None = None, min_size: int = 0
    ) -> FileRecord:
        """Copy ``name`` to a local file and return its size and checksums.

        The size on the volume is checked first (one ``stat``/``HEAD``), against ``expected_size``
        (bytes, the manifest's record) or at least ``min_size`` (what the items need, for checkpoints
        without a manifest: then only those first ``min_size`` bytes are copied), and no more than
        that is ever read: a data file replaced by a huge or endless one (a sparse file, a symlink to
        ``/dev/zero``) cannot fill the staging disk.

        The default opens ``name`` with :meth:`open_read`, checks the size it reports, and copies at
        most that many bytes, checksumming on the way.

        Raises:
            CorruptCheckpointError: ``name`` does not exist, is not a regular file, has another size
                than ``expected_size`` or less than ``min_size``, or changed size while copied.
            TransferError: the copy failed for another reason.
        """
        where = self.url_of(name)
        digest = Digest()
        try:
            with self.open_read(name) as (src, actual):
                size = self._check_size(name, actual, expected_size, min_size)
                with open(local_path, "wb") as dst:
                    copied = copy_stream(src, dst, digest, limit=size)
        except UCCheckpointError:
            raise
        except self._store_errors as exc:
            raise TransferError(f"downloading {where} to {local_path} failed: {exc}") from exc
        self._check_copied(name, copied, size)
        return digest.record(name)

    # ---- shared wording -----------------------------------------------------------------------
    def _missing(self, name: str) -> CorruptCheckpointError:
        """The error for a checkpoint file that is not there (raise it, ``from`` the store's)."""
        return CorruptCheckpointError(f"checkpoint file {self.url_of(name)} is missing")

    def _truncated(self, name: str, start: int, end: int, got: int) -> CorruptCheckpointError:
        """The error for a read of bytes ``[start, end)`` of ``name`` that gave only ``got`` bytes."""
        return CorruptCheckpointError(
            f"checkpoint file {self.url_of(name)} is truncated: bytes {start}-{end - 1} needed, got {got}"
        )

    def _check_size(self, name: str, actual: int | None, expected_size: int | None, min_size: int) -> int:
        """The one wording of a missing or wrongly sized data file; returns how many bytes to read:
        the whole file when its size is known from a manifest, else only the ``min_size`` bytes the
        items need (a stock checkpoint's file may have grown; nothing past them is of use)."""
        where = self.url_of(name)
        if actual is None:
            raise self._missing(name)
        if expected_size is not None and actual != expected_size:
            raise CorruptCheckpointError(
                f"checkpoint file {where} has {actual} bytes, the checkpoint recorded {expected_size} "
                "(truncated, appended to or replaced)"
            )
        if actual < min_size:
            raise CorruptCheckpointError(
                f"checkpoint file {where} has {actual} bytes, the checkpoint needs at least {min_size}"
            )
        return actual if expected_size is not None or min_size <= 0 else min_size

    def _check_copied(self, name: str, copied: int, size: int) -> None:
        if copied != size:
            raise CorruptCheckpointError(
                f"checkpoint file {self.url_of(name)} changed while it was read: {copied} bytes read, {size} expected"
            )

    @abstractmethod
    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name``.

        Raises:
            CorruptCheckpointError: ``name`` does not exist or is shorter than ``end``.
            TransferError: the read failed for another reason.
        """

    def read_range_into(
        self, name: str, start: int, out: memoryview | Sequence[memoryview], *, file_size: int | None = None
    ) -> None:
        """Bytes ``[start, start + len(out))`` of ``name``, written into ``out``: a writable,
        byte-formatted buffer, or several filled one after the other (one read scattered over them:
        a load receives a large tensor's bytes straight into the tensor, the archive records around
        it into a buffer). Stores that can receive straight into the caller's memory override
        this; the default copies what :meth:`read_range` returns.

        Args:
            file_size: the whole file's size in bytes as the checkpoint recorded it. Volumes that
                learn the file's size from the read itself (S3's ``Content-Range``, a local file's
                ``fstat``, the in-memory store) then refuse a file of another size, so that bytes
                appended to a data file after its save are found by a ranged load as by a
                whole-file one; the default (fsspec) would need one more request per read and does
                not check.

        Raises:
            CorruptCheckpointError: ``name`` does not exist, is shorter than the range, or (with
                ``file_size``) has another size.
            TransferError: the read failed for another reason.
        """
        views = [out] if isinstance(out, memoryview) else list(out)
        data = memoryview(self.read_range(name, start, start + sum(map(len, views))))
        pos = 0
        for view in views:
            view[:] = data[pos : pos + len(view)]
            pos += len(view)

    @abstractmethod
    def read_bytes(self, name: str) -> bytes | None:
        """The whole content of a small file, or ``None`` if it does not exist."""

    #: Whether :meth:`upload_file`'s record is the store's own word that the file is there whole
    #: (an object store's answer to the upload, or a HEAD after it, on a read-after-write
    #: consistent store): a save then publishes without listing its data files again. False where a
    #: write can be reported done and lost (FUSE mounts) or the check is not made (fsspec).
    verifies_uploads: bool = False

    def write_tagged(self, name: str, data: bytes) -> str | None:
        """Write a small file, replacing it (as :meth:`publish_bytes`), and return the store's
        version tag of what was written (an object store's ETag), or None where the volume has no
        tags (then :meth:`tag_of` gives None too, and callers read the content back instead).

        Raises:
            TransferError: the write failed (the file is not on the volume after it).
        """
        try:
            self.publish_bytes(name, data, overwrite=True)
        except LandedSizeError:
            # The file written here is one that other writers replace too (a location's claim: the
            # last save to claim it publishes), so another size read back may be another writer's
            # file written meanwhile, not a lost write. Callers read the content back (tags are
            # None here) and tell the two apart; only a file that is gone is this write's failure.
            if self.size(name) is None:
                raise
        return None

    def tag_of(self, name: str) -> str | None:
        """The version tag of ``name`` now (see :meth:`write_tagged`), None for a missing file or a
        volume without tags. One request on an object store (HEAD), no body read.

        Raises:
            TransferError / VolumeError: the store could not be asked.
        """
        return None

    @abstractmethod
    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
        """Write a small file so that readers see either the old content or all of the new one.

        Where the store has an atomic primitive it is used (a temp file, fsync and rename on a local
        disk; one PUT on an object store); where it has none (FUSE mounts that refuse rename) the
        final file is written once. With ``overwrite=False`` an existing file is not replaced.

        Returns:
            True when the store's answer to the write itself proves it stored exactly ``data`` (an
            object store reporting the checksum of what it stored); False when only reading the file
            back can tell (a mount may report a write or rename as done and lose it).

        Raises:
            CheckpointExistsError: ``overwrite=False`` and ``name`` exists.
            LandedSizeError: (a ``TransferError``) the volume checks by reading the size back, and
                it differs: the write was lost, or another writer replaced the file meanwhile.
            TransferError: the write failed.
        """

    @abstractmethod
    def delete(self, name: str) -> None:
        """Delete ``name``; a missing file is not an error."""

    def remove_if_empty(self) -> None:
        """Remove the location itself when it is an empty directory (stores with real directories);
        object stores have nothing to remove once the files are gone."""

    def abort_incomplete_uploads(
        self,
        older_than_s: float | None = None,
        keep: Callable[[str], bool] | None = None,
        within: Callable[[str], bool] | None = None,
    ) -> int:
        """Abort uploads left unfinished at this location (S3 multipart uploads) that were started
        more than ``older_than_s`` seconds ago (all when None), except those of a file ``keep(name)``
        says to keep (``name`` relative to the location); return how many. Stores without such
        state have nothing to do.

        ``within(name)`` chooses the uploads the call covers (``name`` relative to this location, at
        any depth, ``/``-separated); by default those of the files of this location itself, not of a
        location below it. ``gc`` passes one that covers every checkpoint location under a root, so
        that one listing of the uploads serves them all."""
        return 0

    def close(self) -> None:
        """Release clients and pools (they are created again on next use)."""
