"""The small interface every volume backend implements.

A :class:`Volume` is a flat namespace of files under one root: a local or FUSE-mounted directory,
an S3 prefix, or an fsspec URL. The DCP adapters only ever use these calls, so a backend is one
module with one class. The shape follows fsspec's ``AbstractFileSystem`` (one interface, chosen by
URL) cut down to what checkpointing needs, and torchsnapshot's storage plugins (write, read, delete).
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

#: Bytes per read/write when a backend streams a file through Python (1 MiB: per-call overhead is
#: already negligible, and a pool of workers holds only a few MiB of buffers).
CHUNK_SIZE = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """What was transferred: a file's name on the volume, its size in bytes and its CRC-32.

    ``crc32`` is the zlib CRC-32 of the whole file as 8 lowercase hex digits (the same polynomial as
    S3's ``CRC32`` checksum).
    """

    name: str
    size: int
    crc32: str


class Crc32:
    """Running CRC-32 (zlib) of a byte stream; ``zlib.crc32`` releases the GIL on large buffers, so
    worker threads checksum in parallel."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def copy_stream(src: BinaryIO, dst: BinaryIO, buffer: bytearray | None = None) -> tuple[int, str]:
    """Copy ``src`` to ``dst`` in :data:`CHUNK_SIZE` pieces; return ``(bytes copied, crc32 hex)``."""
    buf = buffer if buffer is not None else bytearray(CHUNK_SIZE)
    view = memoryview(buf)
    crc = Crc32()
    total = 0
    while True:
        n = src.readinto(view)  # type: ignore[attr-defined]
        if not n:
            break
        chunk = view[:n]
        crc.update(chunk)
        dst.write(chunk)
        total += n
    return total, crc.hexdigest()


def file_crc32(path: Path) -> tuple[int, str]:
    """Size in bytes and CRC-32 (hex) of a local file, read in :data:`CHUNK_SIZE` pieces."""
    buf = bytearray(CHUNK_SIZE)
    view = memoryview(buf)
    crc = Crc32()
    total = 0
    with open(path, "rb") as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            crc.update(view[:n])
            total += n
    return total, crc.hexdigest()


class Volume(ABC):
    """A checkpoint location on some store; every name is relative to :attr:`url`.

    Implementations must be picklable and cheap to construct: DCP's PROCESS mode pickles the storage
    writer (and so its volume) into a daemon process. Clients, sessions and pools are created lazily.
    """

    #: The location's canonical URL or path, used in every error message.
    url: str

    def describe(self, name: str) -> str:
        """The full URL or path of ``name`` for messages."""
        return f"{self.url.rstrip('/')}/{name}"

    @abstractmethod
    def child(self, name: str) -> Volume:
        """The location ``name`` below this one (for example one step's checkpoint under a root)."""

    # ---- checks -------------------------------------------------------------------------------
    @abstractmethod
    def prepare_for_write(self, create_parents: bool = True) -> None:
        """Make sure files can be written here, creating the location if the store needs it.

        Raises:
            VolumeError: the location is a file, its parent does not exist (with
                ``create_parents=False``), or it is not writable. The message names the path.
        """

    @abstractmethod
    def list_files(self) -> dict[str, int]:
        """Names and sizes (bytes) of the files directly at this location; ``{}`` if it does not
        exist. Sub-locations are listed as names ending in ``/`` with size ``-1``."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size of ``name`` in bytes, or ``None`` if it does not exist."""

    # ---- data movement ------------------------------------------------------------------------
    @abstractmethod
    def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
        """Copy a finished local file to ``name`` and return what landed.

        The file is written under its final name (no rename): nobody reads data files before
        ``.metadata`` points at them. With ``sync`` the data is made durable before returning.

        Raises:
            TransferError: the copy failed; the message names both ends.
        """

    @abstractmethod
    def download_file(self, name: str, local_path: Path) -> FileRecord:
        """Copy ``name`` to a local file and return its size and CRC-32.

        Raises:
            CorruptCheckpointError: ``name`` does not exist.
            TransferError: the copy failed for another reason.
        """

    @abstractmethod
    def read_bytes(self, name: str) -> bytes | None:
        """The whole content of a small file, or ``None`` if it does not exist."""

    @abstractmethod
    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> None:
        """Write a small file so that readers see either the old content or all of the new one.

        Where the store has an atomic primitive it is used (a temp file, fsync and rename on a local
        disk; one PUT on an object store); where it has none (FUSE mounts that refuse rename) the
        final file is written once. With ``overwrite=False`` an existing file is not replaced.

        Raises:
            CheckpointExistsError: ``overwrite=False`` and ``name`` exists.
            TransferError: the write failed.
        """

    @abstractmethod
    def delete(self, name: str) -> None:
        """Delete ``name``; a missing file is not an error."""
