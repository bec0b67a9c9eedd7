"""A volume on any fsspec filesystem (``gs://``, ``abfs://``, ``memory://``, ``hdfs://``, ...).

Data files are streamed once under their final names (``fs.open(path, "wb")``); ``.metadata`` is
published with one ``pipe_file`` call, which object-store filesystems turn into one PUT (atomic per
object), with ``mode="create"`` when not overwriting. How atomic that is depends on the filesystem:
on object stores it is; fsspec's local filesystem writes in place, which is why plain paths and
``file://`` URLs go to :class:`~uc_checkpoint.volumes.local.LocalVolume` (temp file + rename)
unless an ``FsspecVolume`` is built explicitly.

``memory://`` lives in one process: it works for ``dcp.save`` and THREAD-mode ``async_save``, not
for PROCESS mode, whose daemon process sees an empty memory filesystem.

Listing caches: s3fs, gcsfs and others keep every listing in ``fs.dircache`` with no expiry by
default and answer ``ls``, ``info``, ``exists`` and ``size`` from it; fsspec also shares one
filesystem instance per protocol and options within a process. A checkpoint another process (or
DCP's PROCESS-mode daemon) published would then stay invisible to ``latest()`` forever, and a save's
own checks could read a stale size. So every listing, size and read here first drops the cached
listings of the path and its parents (``fs.invalidate_cache``) and asks ``ls``/``info`` with
``refresh=True`` where the filesystem's method takes that argument.

Reads never share a file handle: fsspec's memory filesystem answers every ``open()`` of a file with
the same object (rewound on each open), so two reads that each opened it would move each other's
position, and two loads of one checkpoint at once would fail their checksums. Every read here is
the filesystem's own ranged primitive, ``cat_file(path, start, end)``, which keeps no state between
calls (object stores: one ranged GET; fsspec's default: a fresh handle per call); whole-file
downloads are a series of such pieces, so neither is held in memory whole.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from uc_checkpoint.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    LandedSizeError,
    TransferError,
    VolumeError,
)
from uc_checkpoint.format.integrity import Digest, FileRecord
from uc_checkpoint.volumes.base import Entry, FileStat, Volume
from uc_checkpoint.volumes.locations import canonical_key_path
from uc_checkpoint.volumes.process_local import ProcessLocal
from uc_checkpoint.volumes.ranged import RangedStream
from uc_checkpoint.volumes.retry import retry

logger = logging.getLogger(__name__)

#: Times a listing is made when entries vanish while it runs (see ``FsspecVolume._scan``).
LIST_ATTEMPTS = 3

#: Bytes per ``cat_file`` request of a whole-file download (one piece in memory at a time per
#: download; on object stores each piece is one ranged GET, so larger means fewer requests).
DOWNLOAD_PIECE_BYTES = 8 << 20


class FsspecVolume(Volume):
    """A checkpoint location given as an fsspec URL.

    Args:
        url: e.g. ``gs://bucket/run1/step_00000100`` or ``memory://ckpt``.
        storage_options: passed to the filesystem (credentials, endpoints, ...); they travel with
            the volume when DCP's PROCESS mode pickles it, so they must be picklable.

    Raises:
        VolumeError: fsspec knows no filesystem for the URL's protocol (or its package is not
            installed).
    """

    prefers_ranged_reads = True
    _store_errors = (Exception,)  # fsspec filesystems raise their stores' own exception types

    def __init__(self, url: str, **storage_options: Any) -> None:
        import fsspec

        protocol = url.split("://", 1)[0] if "://" in url else "file"
        try:
            fs_class = fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise VolumeError(f"no filesystem for {url!r}: {exc}") from exc
        # One spelling per place (uc_checkpoint.volumes.locations): what the filesystem itself
        # makes of the URL, with empty segments dropped (memory://a and memory:///a are one place,
        # memory:///a; a leading slash the filesystem keeps stays, its paths may be absolute).
        path = canonical_key_path(fs_class._strip_protocol(url), url)
        self.url = f"{protocol}://{path}"
        self.storage_options = storage_options
        # This process's (filesystem, root path), resolved on first use; a pickled copy resolves its own.
        self._resolved: ProcessLocal[tuple[Any, str]] = ProcessLocal()

    def __repr__(self) -> str:
        return f"FsspecVolume({self.url!r})"

    def _resolve(self) -> tuple[Any, str]:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(self.url, **self.storage_options)
        return fs, root

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (resolved on first use in each process)."""
        return self._resolved.get(self._resolve)[0]

    @property
    def root(self) -> str:
        """The location's path inside :attr:`fs`."""
        return self._resolved.get(self._resolve)[1].rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def child(self, name: str) -> FsspecVolume:
        return FsspecVolume(f"{self.url}/{name}", **self.storage_options)

    def with_location(self, location: str) -> FsspecVolume | None:
        """A URL of this volume's protocol as a volume with the same storage options; None for any
        other location."""
        protocol = self.url.split("://", 1)[0]
        if "://" not in location or location.split("://", 1)[0].lower() != protocol:
            return None
        return FsspecVolume(location, **self.storage_options)

    # ---- listing caches -----------------------------------------------------------------------
    def _fresh(self, path: str) -> None:
        """Forget what the filesystem cached about ``path`` and its directory, so that the next call
        asks the store. s3fs and gcsfs drop the path and all its parents; the parent is named too,
        for filesystems that drop only the path given (``info`` of a file reads its parent's
        listing)."""
        fs = self.fs
        fs.invalidate_cache(path)
        parent = path.rstrip("/").rsplit("/", 1)[0]
        if parent and parent != path:
            fs.invalidate_cache(parent)

    def _ls(self, path: str, detail: bool = True) -> Any:
        self._fresh(path)
        return self.fs.ls(path, detail=detail, **_refresh_kwargs(self.fs.ls))

    def _root_exists(self) -> bool:
        try:
            self._fresh(self.root)
            return bool(self.fs.exists(self.root))
        except Exception:  # noqa: BLE001 - cannot tell: list again, and fail there if it persists
            return True

    def _info(self, path: str) -> dict[str, Any]:
        self._fresh(path)
        return self.fs.info(path, **_refresh_kwargs(self.fs.info))

    # ---- checks -------------------------------------------------------------------------------
    def prepare_for_write(self, create_parents: bool = True) -> None:
        fs, root = self.fs, self.root
        try:
            self._fresh(root)
            if fs.isfile(root):
                raise VolumeError(f"checkpoint location {self.url} is a file, not a directory")
            if not create_parents and not fs.exists(root.rsplit("/", 1)[0] or "/"):
                raise VolumeError(
                    f"cannot create checkpoint location {self.url}: its parent does not exist (create_parents=False)"
                )
            fs.makedirs(root, exist_ok=True)
        except VolumeError:
            raise
        except Exception as exc:  # noqa: BLE001 - any filesystem's error, named
            raise VolumeError(f"cannot write checkpoint location {self.url}: {exc}") from exc

    def _scan(self) -> list[Entry]:
        """One ``ls(detail=True)`` of the location (a missing one lists as empty: object-store
        filesystems cannot tell an empty prefix from a missing one, so none is reported missing).

        A listing that fails on an entry deleted while it ran (fsspec's local filesystem stats each
        entry it found: FileNotFoundError; its memory filesystem: KeyError) is made again, up to
        :data:`LIST_ATTEMPTS` times, at once (:func:`~uc_checkpoint.volumes.retry.retry`); only a
        location that is itself gone lists as empty. Read as empty, a save's marker deleted
        meanwhile would hide every checkpoint there."""

        def attempt() -> list[dict[str, Any]] | None:
            try:
                return self._ls(self.root)
            except FileNotFoundError:
                if not self._root_exists():
                    return None  # the location itself is gone
                raise
            except KeyError:
                raise  # retried, as an entry that vanished
            except Exception as exc:  # noqa: BLE001
                raise TransferError(f"listing {self.url} failed: {exc}") from exc

        try:
            found = retry(attempt, attempts=LIST_ATTEMPTS, retry_on=(FileNotFoundError, KeyError))  # at once
        except (FileNotFoundError, KeyError) as error:
            raise TransferError(
                f"listing {self.url} failed {LIST_ATTEMPTS} times, each on an entry that vanished while "
                f"it ran: {error!r}"
            ) from error
        if found is None:
            return []
        out: list[Entry] = []
        for entry in found:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if not name or entry["name"].rstrip("/") == self.root:
                continue  # the location itself (ls of a file lists the file)
            if entry.get("type") == "directory":
                out.append(Entry(name + "/", -1))
            else:
                out.append(Entry(name, int(entry.get("size") or 0), _mtime_of(entry)))
        return out

    def exists(self) -> bool:
        """``True`` unless the location is a file (one ``info``): fsspec filesystems on object
        stores have no directories, and a missing location lists as empty.

        Raises:
            VolumeError: the location is a file, not a directory.
            TransferError: the filesystem failed to answer.
        """
        try:
            kind = self._info(self.root).get("type")
        except FileNotFoundError:
            return True
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"stat of {self.url} failed: {exc}") from exc
        if kind == "file":
            raise VolumeError(f"checkpoint location {self.url} is a file, not a directory")
        return True

    def size(self, name: str) -> int | None:
        try:
            info = self._info(self._path(name))
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"stat of {self.url_of(name)} failed: {exc}") from exc
        return None if info.get("type") == "directory" else int(info.get("size") or 0)

    def stat(self, name: str) -> FileStat | None:
        """One fresh ``info``: size, modification time (as :meth:`list_mtimes` reads it) and the
        ETag where the filesystem reports one (s3fs, gcsfs, http)."""
        try:
            info = self._info(self._path(name))
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"stat of {self.url_of(name)} failed: {exc}") from exc
        if info.get("type") == "directory":
            return None
        mtime = _mtime_of(info)
        etag = info.get("ETag") or info.get("etag")
        return FileStat(
            int(info.get("size") or 0),
            None if mtime is None else int(mtime * 1_000_000_000),
            str(etag).strip('"') if etag else None,
        )

    # ---- data movement ------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool = True) -> Iterator[BinaryIO]:
        """``fs.open(path, "wb")``: object-store filesystems upload the object when it is closed
        (``sync`` has nothing more to do)."""
        if "/" in name:  # a spread prefix's data file; a no-op on stores without directories
            self.fs.makedirs(self._path(name).rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(self._path(name), "wb") as dst:
            yield dst

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[tuple[BinaryIO, int]]:
        """``name`` as a read-only, seekable stream of its own (bytes read with ``cat_file`` ranges,
        never through a shared ``fs.open`` handle), with its size in bytes from a fresh ``info``; the
        stream ends at that size even if the file has grown since.

        Raises:
            CorruptCheckpointError: ``name`` does not exist (also when it goes while read), or is a
                directory.
            TransferError: a read failed for another reason.
        """
        size = self.size(name)  # drops the listing caches first
        if size is None:
            raise self._missing(name)
        with RangedStream(lambda start, end: self._cat(name, start, end), size) as src:
            yield cast(BinaryIO, src), size

    def download_file(
        self, name: str, local_path: Path, *, expected_size: int | None = None, min_size: int = 0
    ) -> FileRecord:
        """As :meth:`Volume.download_file`, in ``cat_file`` pieces of :data:`DOWNLOAD_PIECE_BYTES`
        (no shared handle: downloads of one file at once are independent; one piece in memory at a
        time), and never past the size checked first.

        Raises:
            CorruptCheckpointError: ``name`` does not exist (or goes while copied), has another size
                than ``expected_size`` or less than ``min_size``, or shrank while copied.
            TransferError: a read or the local write failed for another reason.
        """
        size = self._check_size(name, self.size(name), expected_size, min_size)
        digest = Digest()
        copied = 0
        try:
            with open(local_path, "wb") as dst:
                while copied < size:
                    want = min(DOWNLOAD_PIECE_BYTES, size - copied)
                    piece = self._cat(name, copied, copied + want)
                    digest.update(piece)
                    dst.write(piece)
                    copied += len(piece)
                    if len(piece) < want:
                        break  # the file ended early: _check_copied names it
        except OSError as exc:
            raise TransferError(f"downloading {self.url_of(name)} to {local_path} failed: {exc}") from exc
        self._check_copied(name, copied, size)
        return digest.record(name)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name`` (one ``cat_file``, after dropping cached listings).

        Raises:
            ValueError: ``start`` is negative or ``end`` is before it (``cat_file`` would read a
                negative bound from the end of the file).
            CorruptCheckpointError / TransferError: as :meth:`Volume.read_range`.
        """
        data = self._cat(name, start, end, fresh=True)
        if len(data) != end - start:
            raise self._truncated(name, start, end, len(data))
        return data

    def _cat(self, name: str, start: int, end: int, *, fresh: bool = False) -> bytes:
        """Bytes ``[start, end)`` of ``name``, or fewer where the file ends first: one call of the
        filesystem's ranged read, which holds no position between calls (with ``fresh``, after
        dropping the cached listings of the file, :meth:`_fresh`).

        Raises:
            ValueError: ``start < 0`` or ``end < start``.
            CorruptCheckpointError: ``name`` does not exist or is a directory.
            TransferError: the read failed for another reason (the message names the bytes and file).
        """
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range {start}-{end} of {self.url_of(name)}")
        try:
            if fresh:
                self._fresh(self._path(name))
            data = self.fs.cat_file(self._path(name), start=start, end=end)
        except FileNotFoundError as exc:
            raise self._missing(name) from exc
        except IsADirectoryError as exc:
            raise CorruptCheckpointError(f"{self.url_of(name)} is a directory, not a file") from exc
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"reading bytes {start}-{end - 1} of {self.url_of(name)} failed: {exc}") from exc
        return data if type(data) is bytes else bytes(data)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            self._fresh(self._path(name))
            return bytes(self.fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None
        except IsADirectoryError as exc:
            raise CorruptCheckpointError(f"{self.url_of(name)} is a directory, not a file") from exc
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"reading {self.url_of(name)} failed: {exc}") from exc

    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
        where = self.url_of(name)
        try:
            if overwrite:
                self.fs.pipe_file(self._path(name), data)
            else:
                self._fresh(self._path(name))
                if self.fs.exists(self._path(name)):
                    raise FileExistsError(where)
                self.fs.pipe_file(self._path(name), data, mode="create")
        except FileExistsError as exc:
            raise CheckpointExistsError(f"{where} already exists and overwrite=False") from exc
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"publishing {where} failed: {exc}") from exc
        landed = self.size(name)
        if landed != len(data):
            raise LandedSizeError(f"publishing {where}: {landed} bytes on the volume, expected {len(data)}")
        return False  # a size is not the content: a caching layer may keep the old object's bytes

    def remove_if_empty(self) -> None:
        try:
            if not self._ls(self.root, detail=False):
                self.fs.rmdir(self.root)
        except Exception:  # noqa: BLE001 - stores without directories, or not empty: nothing to do
            pass

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"deleting {self.url_of(name)} failed: {exc}") from exc


def _mtime_of(entry: dict[str, Any]) -> float | None:
    """An ``ls`` record's last-modified time in Unix seconds, or None when it has none."""
    # Backends name it differently (local: mtime, s3fs: LastModified, memory: created).
    stamp: Any = entry.get("mtime") or entry.get("LastModified") or entry.get("created")
    if hasattr(stamp, "timestamp"):
        stamp = stamp.timestamp()
    return float(stamp) if isinstance(stamp, (int, float)) else None


def _refresh_kwargs(method: Any) -> dict[str, Any]:
    """``{"refresh": True}`` when ``method`` (a filesystem's ``ls`` or ``info``) names a ``refresh``
    parameter (s3fs, gcsfs), else ``{}``: others either have no cache or would pass an unknown
    keyword on to their store's API and fail."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):  # builtins and some C-implemented callables have none
        return {}
    return {"refresh": True} if "refresh" in params else {}
