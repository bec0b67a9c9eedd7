"""The small interface every volume backend implements.

A :class:`Volume` is a flat namespace of files under one root: a local or FUSE-mounted directory,
an S3 prefix, or an fsspec URL. The DCP adapters only ever use these calls, so a backend is one
module with one class. The shape follows fsspec's ``AbstractFileSystem`` (one interface, chosen by
URL) cut down to what checkpointing needs, and torchsnapshot's storage plugins (write, read, delete).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from ..errors import CorruptCheckpointError
from ..integrity import FileRecord

__all__ = ["FileRecord", "Volume"]


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

    #: Requests retried so far by this volume's client (throttling, 5xx, timeouts, cut bodies);
    #: stores without retries leave it at 0. Read it before and after a transfer for its count.
    retries: int = 0

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

    def list_mtimes(self) -> dict[str, float]:
        """Last-modified time (Unix seconds) of each file directly at this location; ``{}`` if it
        does not exist. Garbage collection uses it to spare files a save may still be writing. A
        store that does not report times returns none, and nothing of it is collected by age."""
        return {}

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size of ``name`` in bytes, or ``None`` if it does not exist."""

    # ---- data movement ------------------------------------------------------------------------
    @abstractmethod
    def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
        """Copy a finished local file to ``name``, verify what landed, and return its record
        (size, CRC-32, block CRC-32s; see :mod:`uc_checkpoint.integrity`).

        The file is written under its final name (no rename): nobody reads data files before
        ``.metadata`` points at them. With ``sync`` the data is made durable before returning.
        Verification: the size on the volume, and the store's own checksum where it keeps one.

        Raises:
            TransferError: the copy failed or landed with another size or checksum; the message
                names both ends.
        """

    @abstractmethod
    def download_file(
        self, name: str, local_path: Path, *, expected_size: int | None = None, min_size: int = 0
    ) -> FileRecord:
        """Copy ``name`` to a local file and return its size and checksums.

        The size on the volume is checked first (one ``stat``/``HEAD``), against ``expected_size``
        (bytes, the manifest's record) or at least ``min_size`` (what the items need, for checkpoints
        without a manifest: then only those first ``min_size`` bytes are copied), and no more than
        that is ever read: a data file replaced by a huge or endless one (a sparse file, a symlink to
        ``/dev/zero``) cannot fill the staging disk.

        Raises:
            CorruptCheckpointError: ``name`` does not exist, is not a regular file, has another size
                than ``expected_size`` or less than ``min_size``, or changed size while copied.
            TransferError: the copy failed for another reason.
        """

    def _check_size(self, name: str, actual: int | None, expected_size: int | None, min_size: int) -> int:
        """The one wording of a missing or wrongly sized data file; returns how many bytes to read:
        the whole file when its size is known from a manifest, else only the ``min_size`` bytes the
        items need (a stock checkpoint's file may have grown; nothing past them is of use)."""
        where = self.describe(name)
        if actual is None:
            raise CorruptCheckpointError(f"checkpoint file {where} is missing")
        if expected_size is not None and actual != expected_size:
            raise CorruptCheckpointError(
                f"checkpoint file {where} has {actual} bytes, the checkpoint recorded {expected_size} "
                "(truncated or replaced)"
            )
        if actual < min_size:
            raise CorruptCheckpointError(
                f"checkpoint file {where} has {actual} bytes, the checkpoint needs at least {min_size}"
            )
        return actual if expected_size is not None or min_size <= 0 else min_size

    def _check_copied(self, name: str, copied: int, size: int) -> None:
        if copied != size:
            raise CorruptCheckpointError(
                f"checkpoint file {self.describe(name)} changed while it was read: {copied} bytes read, {size} expected"
            )

    @abstractmethod
    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name``.

        Raises:
            CorruptCheckpointError: ``name`` does not exist or is shorter than ``end``.
            TransferError: the read failed for another reason.
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

    def remove_if_empty(self) -> None:
        """Remove the location itself when it is an empty directory (stores with real directories);
        object stores have nothing to remove once the files are gone."""

    def abort_incomplete_uploads(self, older_than_s: float | None = None) -> int:
        """Abort uploads left unfinished at this location (S3 multipart uploads) that were started
        more than ``older_than_s`` seconds ago (all when None); return how many. Stores without such
        state have nothing to do."""
        return 0

    def close(self) -> None:
        """Release clients and pools (they are created again on next use)."""
