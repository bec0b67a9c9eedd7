"""A volume that is a directory: local disk, NFS, or a FUSE mount of an object store.

FUSE mounts of object stores (s3fs, Mountpoint, gcsfuse, rclone) often refuse ``rename``, turn
``fsync`` into an upload, and misbehave on random writes. So data files are written once, in order,
under their final names, and only ``.metadata`` is published with a temp file and rename, falling
back to a single in-place write where rename is refused, and to delete-then-create where the mount
also refuses to overwrite an existing file (see :meth:`LocalVolume.publish_bytes`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from uc_checkpoint.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    LandedSizeError,
    TransferError,
    VolumeError,
)
from uc_checkpoint.volumes.base import Entry, FileStat, Volume

logger = logging.getLogger(__name__)

# errno values with which FUSE and network filesystems refuse an operation they do not implement.
_UNSUPPORTED = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EPERM, errno.EINVAL}


def _fsync(fd: int, what: str) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            # Some FUSE filesystems have no fsync; their close() is the durability point.
            logger.debug("fsync not supported for %s (%s); relying on close", what, exc)
        else:
            raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        _fsync(fd, str(path))
    except OSError as exc:
        logger.debug("directory fsync failed for %s: %s", path, exc)
    finally:
        os.close(fd)


def _write_whole(path: Path, data: bytes, mode: str) -> None:
    """Write ``data`` as the file ``path`` (``mode`` "wb" or "xb") and fsync it; a write that fails
    after the file was opened removes it, so no truncated file is left where a reader looks.

    Raises:
        OSError: as ``open``, ``write`` or ``fsync`` raised it.
    """
    f = open(path, mode)  # noqa: SIM115 - closed below, inside the try: FUSE mounts upload on close, which can fail
    try:
        with f:
            f.write(data)
            f.flush()
            _fsync(f.fileno(), str(path))
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _open_regular(path: Path) -> io.BufferedReader:
    """``path`` opened for reading, or CorruptCheckpointError when it is not a regular file: a FIFO
    would block the open itself (hence O_NONBLOCK), a device (``/dev/zero``) never ends, and a
    directory is no data at all; their sizes say nothing about what reading them gives."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptCheckpointError(f"checkpoint file {path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class LocalVolume(Volume):
    """A checkpoint location that is a directory on a mounted filesystem.

    Args:
        path: the directory (it need not exist yet). ``~`` is expanded; relative paths are made
            absolute against the current directory when the volume is created.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
        self.url = str(self.root)

    def __repr__(self) -> str:
        return f"LocalVolume({self.url!r})"

    def _path(self, name: str) -> Path:
        return self.root / name

    def child(self, name: str) -> LocalVolume:
        return LocalVolume(self.root / name)

    # ---- checks -------------------------------------------------------------------------------
    def prepare_for_write(self, create_parents: bool = True) -> None:
        root = self.root
        if root.exists() and not root.is_dir():
            raise VolumeError(f"checkpoint location {root} is a file, not a directory")
        if not root.exists():
            # Find the deepest existing ancestor to report the real culprit.
            ancestor = root.parent
            while not ancestor.exists():
                ancestor = ancestor.parent
            if not ancestor.is_dir():
                raise VolumeError(f"cannot create checkpoint location {root}: {ancestor} is a file")
            if not create_parents and ancestor != root.parent:
                raise VolumeError(
                    f"cannot create checkpoint location {root}: parent directory {root.parent} does "
                    "not exist (create_parents=False)"
                )
            if not os.access(ancestor, os.W_OK | os.X_OK):
                raise VolumeError(f"cannot create checkpoint location {root}: {ancestor} is not writable")
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise VolumeError(f"cannot create checkpoint location {root}: {exc.strerror}") from exc
        # access() reports EROFS even for root, which ignores permission bits.
        if not os.access(root, os.W_OK | os.X_OK):
            raise VolumeError(f"checkpoint location {root} is not writable")

    def _scan(self) -> list[Entry] | None:
        """One ``scandir`` of the directory, one ``stat`` per file (none per sub-directory)."""
        try:
            found = list(os.scandir(self.root))
        except FileNotFoundError:
            return None
        except NotADirectoryError as exc:
            raise VolumeError(f"checkpoint location {self.root} is a file, not a directory") from exc
        except OSError as exc:  # EIO, ENOTCONN (a FUSE daemon that died), EACCES: not "empty"
            raise TransferError(f"listing {self.root} failed: {exc}") from exc
        out: list[Entry] = []
        for entry in found:
            try:
                if entry.is_dir(follow_symlinks=False):
                    out.append(Entry(entry.name + "/", -1))
                else:
                    st = entry.stat()
                    out.append(Entry(entry.name, st.st_size, st.st_mtime))
            except FileNotFoundError:
                continue  # deleted while listing
            except OSError as exc:
                raise TransferError(f"listing {self.root} failed at {entry.name}: {exc}") from exc
        return out

    def exists(self) -> bool:
        """Whether the directory exists (one ``stat``, following symlinks, instead of a listing).

        Raises:
            VolumeError: the location is a file, not a directory.
            TransferError: the file system failed to answer.
        """
        try:
            mode = os.stat(self.root).st_mode
        except (FileNotFoundError, NotADirectoryError):  # missing, or below a file: not there
            return False
        except OSError as exc:
            raise TransferError(f"stat of {self.root} failed: {exc}") from exc
        if not stat.S_ISDIR(mode):
            raise VolumeError(f"checkpoint location {self.root} is a file, not a directory")
        return True

    def size(self, name: str) -> int | None:
        """Size of ``name`` in bytes, or None when it does not exist.

        Raises:
            VolumeError: the location is a file.
            TransferError: the file system failed to answer (not taken for "missing").
        """
        try:
            return self._path(name).stat().st_size
        except FileNotFoundError:
            return None
        except NotADirectoryError as exc:
            raise VolumeError(f"cannot stat {self._path(name)}: a component of {self.root} is a file") from exc
        except OSError as exc:
            raise TransferError(f"stat of {self._path(name)} failed: {exc}") from exc

    def stat(self, name: str) -> FileStat | None:
        """One ``os.stat`` of ``name`` (following symlinks): its size and ``st_mtime_ns``; None when
        it does not exist or is a directory.

        Raises:
            VolumeError: the location is a file.
            TransferError: the file system failed to answer (not taken for "missing").
        """
        path = self._path(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        except NotADirectoryError as exc:
            raise VolumeError(f"cannot stat {path}: a component of {self.root} is a file") from exc
        except OSError as exc:
            raise TransferError(f"stat of {path} failed: {exc}") from exc
        return None if stat.S_ISDIR(st.st_mode) else FileStat(st.st_size, st.st_mtime_ns)

    # ---- data movement ------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool = True) -> Iterator[BinaryIO]:
        """``name`` opened for writing under its final name (data files need no rename: nobody reads
        them before ``.metadata`` points at them); flushed, and fsynced with ``sync``, when the block
        ends without an error."""
        dest = self._path(name)
        if "/" in name:  # a spread prefix's data file: its directory comes with the first one
            dest.parent.mkdir(exist_ok=True)
        with open(dest, "wb") as dst:
            yield dst
            dst.flush()
            if sync:
                _fsync(dst.fileno(), str(dest))

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[tuple[BinaryIO, int]]:
        """``name`` opened for reading (regular files only) with its ``fstat`` size: one open, so
        the size is that of the file being read, not of one that replaced it since."""
        try:
            src = _open_regular(self._path(name))
        except FileNotFoundError as exc:
            raise self._missing(name) from exc
        with src:
            yield src, os.fstat(src.fileno()).st_size

    def read_range(self, name: str, start: int, end: int) -> bytes:
        path = self._path(name)
        try:
            with _open_regular(path) as f:
                f.seek(start)
                data = f.read(end - start)
        except FileNotFoundError as exc:
            raise self._missing(name) from exc
        except OSError as exc:
            raise TransferError(f"reading bytes {start}-{end - 1} of {path} failed: {exc}") from exc
        if len(data) != end - start:
            raise self._truncated(name, start, end, len(data))
        return data

    def read_range_into(
        self, name: str, start: int, out: memoryview | Sequence[memoryview], *, file_size: int | None = None
    ) -> None:
        """As :meth:`Volume.read_range_into`, read straight into ``out`` (no intermediate bytes);
        ``file_size`` is checked against the open file's ``fstat``."""
        path = self._path(name)
        views = [out] if isinstance(out, memoryview) else list(out)
        got = 0
        try:
            with _open_regular(path) as f:
                if file_size is not None:
                    self._check_size(name, os.fstat(f.fileno()).st_size, file_size, 0)
                f.seek(start)
                for view in views:
                    n = f.readinto(view) if len(view) else 0  # buffered: short only at the end of the file
                    got += n
                    if n < len(view):
                        break
        except FileNotFoundError as exc:
            raise self._missing(name) from exc
        except OSError as exc:
            end = start + sum(map(len, views))
            raise TransferError(f"reading bytes {start}-{end - 1} of {path} failed: {exc}") from exc
        nbytes = sum(map(len, views))
        if got != nbytes:
            raise self._truncated(name, start, start + nbytes, got)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            with _open_regular(self._path(name)) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except IsADirectoryError as exc:
            raise CorruptCheckpointError(f"{self._path(name)} is a directory, not a file") from exc
        except NotADirectoryError as exc:
            raise VolumeError(f"checkpoint location {self.root} is a file, not a directory") from exc
        except OSError as exc:
            raise TransferError(f"reading {self._path(name)} failed: {exc}") from exc

    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
        """Write the small file ``name`` (``.metadata``, the ``latest`` pointer, a save marker)
        so that readers see the old content or all of the new, where the mount allows it.

        In order of preference:

        1. a temp file, fsync, then ``rename`` over ``name`` (``link`` with ``overwrite=False``, which
           fails if ``name`` exists): atomic;
        2. where the mount refuses rename/link (FUSE mounts of object stores): ``name`` written once
           in place (created exclusively with ``overwrite=False``); such mounts upload the file when
           it is closed, so it appears whole;
        3. where the mount also refuses to open an existing file for writing (EPERM/EACCES:
           Mountpoint for S3 without ``--allow-overwrite``) and ``overwrite`` is true: the old file
           is deleted, then the new one created. This is not atomic. For the ``latest`` pointer the
           gap only means no pointer for a moment. For the ``.metadata`` of a checkpoint saved again
           at the same location it means the old checkpoint is unpublished until the new
           ``.metadata`` lands (a reader finds no checkpoint there, ``latest()`` skips it), and a
           crash in between leaves the location unpublished: the old checkpoint is lost but nothing
           is ever published over missing data, because the writer publishes only after every new
           data file has landed, and deletes the old ones only after that.

        A write that fails midway removes its partial file rather than leave a truncated one.

        Raises:
            CheckpointExistsError: ``overwrite=False`` and ``name`` exists.
            TransferError: the write failed; with the delete-then-create path after the delete, the
                message says that the old file is gone.
        """
        dest = self._path(name)
        if not overwrite and dest.exists():
            raise CheckpointExistsError(f"{dest} already exists and overwrite=False")
        tmp = self._path(f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                _fsync(f.fileno(), str(tmp))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TransferError(f"writing {tmp} failed: {exc}") from exc
        try:
            if overwrite:
                os.replace(tmp, dest)
            else:
                # link() fails if dest exists: a second writer cannot clobber the first.
                os.link(tmp, dest)
                tmp.unlink()
        except FileExistsError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointExistsError(f"{dest} already exists and overwrite=False") from exc
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                tmp.unlink(missing_ok=True)
                raise TransferError(f"publishing {dest} failed: {exc}") from exc
            # rename/link refused (typical of FUSE mounts of object stores): write the final file
            # once; on such mounts the object appears whole when the file is closed.
            logger.info("rename refused on %s (%s); writing %s in place", self.url, exc, name)
            tmp.unlink(missing_ok=True)
            self._write_in_place(dest, data, overwrite)
        _fsync_dir(self.root)
        if self.size(name) != len(data):
            raise LandedSizeError(f"publishing {dest}: size on the volume differs from {len(data)} bytes")
        return False  # a mount may report a rename as done and lose it: only a read-back tells

    def _write_in_place(self, dest: Path, data: bytes, overwrite: bool) -> None:
        """Steps 2 and 3 of :meth:`publish_bytes` (rename is refused)."""
        try:
            _write_whole(dest, data, "wb" if overwrite else "xb")
            return
        except FileExistsError as exc:  # "xb": another writer published first
            raise CheckpointExistsError(f"{dest} already exists and overwrite=False") from exc
        except OSError as exc:
            if not (overwrite and exc.errno in (errno.EPERM, errno.EACCES) and dest.exists()):
                raise TransferError(f"publishing {dest} failed: {exc}") from exc
            refused = exc
        logger.info(
            "%s refuses to overwrite existing files (%s); replacing %s by deleting it, then creating it (not atomic)",
            self.url,
            refused,
            dest.name,
        )
        try:
            dest.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TransferError(
                f"publishing {dest} failed: the mount refuses to overwrite it ({refused}) and to delete it ({exc})"
            ) from exc
        try:
            _write_whole(dest, data, "xb")
        except OSError as exc:
            raise TransferError(
                f"publishing {dest} failed after the old file was deleted (the mount refuses overwrites), "
                f"so there is none now: {exc}"
            ) from exc

    def remove_if_empty(self) -> None:
        try:
            self.root.rmdir()
        except OSError:
            pass  # not empty (another writer is active there) or already gone: leave it

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TransferError(f"deleting {self._path(name)} failed: {exc}") from exc
