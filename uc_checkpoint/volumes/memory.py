"""A volume in this process's memory: the test double that ships with the library.

:class:`MemoryVolume` is a real :class:`~uc_checkpoint.volumes.base.Volume` over a dict of bytes, so
tests of publishing, the manager, garbage collection or a catalog need neither a disk, a moto server
nor a second process (the idea of httpx's ``MockTransport``: the double is part of the package and
obeys the same contract as the real backends; ``tests/test_volume_contract.py`` runs one suite over
all of them).

It behaves like a local directory, the reference backend:

- locations are directories: :meth:`MemoryVolume.prepare_for_write` creates one (and its parents),
  a file can only be written into an existing one, :meth:`~MemoryVolume.exists` is false for one
  never created, and :meth:`~MemoryVolume.remove_if_empty` removes an empty one;
- every write is atomic (a whole new value replaces the old one under the store's lock), and
  ``publish_bytes(..., overwrite=False)`` refuses an existing file as ``link()`` does;
- each file has a modification time from the store's clock (``time.time`` unless one is given), so
  garbage collection's grace period can be tested without sleeping.

Volumes made by :meth:`~MemoryVolume.child` share their parent's :class:`MemoryStore`; two volumes
built separately share one only when it is passed (``store=``). There is no URL for it:
``open_volume`` has no ``mem://`` scheme, because a URL would need a process-wide registry of stores
(global state) to find the same bytes twice; pass the volume object itself wherever a location is
taken (``UCVolumeWriter(path=volume)``, ``CheckpointManager(volume)``). ``memory://`` is unchanged:
fsspec's own memory filesystem through :class:`~uc_checkpoint.volumes.fsspec_volume.FsspecVolume`.

A memory volume refuses to be pickled: a copy in DCP's PROCESS-mode daemon would write into bytes
nobody reads.
"""

from __future__ import annotations

import contextlib
import errno
import io
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

from uc_checkpoint.errors import CheckpointExistsError, CorruptCheckpointError, TransferError, VolumeError
from uc_checkpoint.volumes.base import Entry, Volume
from uc_checkpoint.volumes.locations import canonical_key_path

__all__ = ["MemoryStore", "MemoryVolume"]


class MemoryStore:
    """The bytes behind a family of :class:`MemoryVolume` objects: files by full path (``a/b/f``)
    with their modification times, and the directories created. Thread-safe: one lock guards both.

    Args:
        clock: returns the time (Unix seconds) stamped on each file written; ``time.time`` by default.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self.files: dict[str, tuple[bytes, float]] = {}
        self.dirs: set[str] = {""}  # "" is the store's root, which always exists

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory: created, or holding a file below it (call under lock)."""
        if path in self.dirs:
            return True
        below = path + "/"
        return any(p.startswith(below) for p in self.files)

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Store ``data`` as the file ``path`` in one step.

        Raises:
            FileNotFoundError: ``path``'s directory does not exist.
            IsADirectoryError: ``path`` is a directory.
            FileExistsError: ``exclusive`` and ``path`` exists.
        """
        parent = path.rpartition("/")[0]
        with self.lock:
            if not self.is_dir(parent):
                raise FileNotFoundError(errno.ENOENT, "no such directory", parent)
            if self.is_dir(path):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            if exclusive and path in self.files:
                raise FileExistsError(errno.EEXIST, "file exists", path)
            self.files[path] = (bytes(data), self.clock())


class MemoryVolume(Volume):
    """A checkpoint location in memory, ``mem://<path>``; each file is ``<path>/<name>`` in a
    :class:`MemoryStore`.

    Args:
        path: the location inside the store (``""`` is its root); empty segments and trailing
            slashes are dropped.
        store: the store to use (to see another volume's files); a new empty one by default.

    Raises:
        VolumeError: a ``.`` or ``..`` segment in ``path``.
    """

    def __init__(self, path: str = "", *, store: MemoryStore | None = None) -> None:
        self.path = canonical_key_path(path, f"mem://{path}").strip("/")
        self.url = f"mem://{self.path}"
        self.store = store if store is not None else MemoryStore()

    def __repr__(self) -> str:
        return f"MemoryVolume({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise VolumeError(
            f"{self.url} lives in this process's memory and cannot be sent to another one (DCP's PROCESS "
            "mode pickles the storage writer); save in THREAD mode or to a shared location"
        )

    def _key(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path else name

    def child(self, name: str) -> MemoryVolume:
        """The location ``name`` below this one, in the same store."""
        return MemoryVolume(self._key(name), store=self.store)

    def with_location(self, location: str) -> MemoryVolume | None:
        """A ``mem://`` URL as a location in this volume's store (no other volume can open it);
        None for any other location."""
        return MemoryVolume(location[len("mem://") :], store=self.store) if location.startswith("mem://") else None

    # ---- checks -------------------------------------------------------------------------------
    def prepare_for_write(self, create_parents: bool = True) -> None:
        store, path = self.store, self.path
        with store.lock:
            if path in store.files:
                raise VolumeError(f"checkpoint location {self.url} is a file, not a directory")
            if store.is_dir(path):
                return
            ancestors = []
            parent = path.rpartition("/")[0]
            while not store.is_dir(parent):
                if parent in store.files:
                    raise VolumeError(f"cannot create checkpoint location {self.url}: mem://{parent} is a file")
                ancestors.append(parent)
                parent = parent.rpartition("/")[0]
            if ancestors and not create_parents:
                raise VolumeError(
                    f"cannot create checkpoint location {self.url}: parent directory mem://{ancestors[0]} does "
                    "not exist (create_parents=False)"
                )
            store.dirs.update(ancestors)
            store.dirs.add(path)

    def _scan(self) -> list[Entry] | None:
        store, path = self.store, self.path
        below = f"{path}/" if path else ""
        with store.lock:
            if path in store.files:
                raise VolumeError(f"checkpoint location {self.url} is a file, not a directory")
            if not store.is_dir(path):
                return None
            out: dict[str, Entry] = {}
            for key, (data, mtime) in store.files.items():
                if key.startswith(below):
                    name, sep, _ = key[len(below) :].partition("/")
                    out[name + sep] = Entry(name + "/", -1) if sep else Entry(name, len(data), mtime)
            for d in store.dirs:
                if d.startswith(below) and d != path:
                    name = d[len(below) :].partition("/")[0] + "/"
                    out.setdefault(name, Entry(name, -1))
        return list(out.values())

    def size(self, name: str) -> int | None:
        with self.store.lock:
            found = self.store.files.get(self._key(name))
        return None if found is None else len(found[0])

    # ---- data movement ------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool = True) -> Iterator[BinaryIO]:
        """A buffer that becomes the file ``name``, whole, when the block ends without an error."""
        buffer = io.BytesIO()
        yield buffer
        key = self._key(name)
        if "/" in name:  # a spread prefix's data file: its directory comes with it, as on a disk
            store, parent = self.store, key.rpartition("/")[0]
            with store.lock:
                if store.is_dir(parent.rpartition("/")[0]) and parent not in store.files:
                    store.dirs.add(parent)
        self.store.write(key, buffer.getvalue())

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[tuple[BinaryIO, int]]:
        data = self._get(name)
        if data is None:
            raise self._missing(name)
        yield io.BytesIO(data), len(data)

    def _get(self, name: str) -> bytes | None:
        """The content of ``name``, None if it does not exist.

        Raises:
            CorruptCheckpointError: ``name`` is a directory.
        """
        key = self._key(name)
        with self.store.lock:
            found = self.store.files.get(key)
            if found is None and self.store.is_dir(key):
                raise CorruptCheckpointError(f"checkpoint file {self.url_of(name)} is not a regular file")
        return None if found is None else found[0]

    def read_range(self, name: str, start: int, end: int) -> bytes:
        data = self._get(name)
        if data is None:
            raise self._missing(name)
        piece = data[start:end]
        if len(piece) != end - start:
            raise self._truncated(name, start, end, len(piece))
        return piece

    def read_range_into(
        self, name: str, start: int, out: memoryview | Sequence[memoryview], *, file_size: int | None = None
    ) -> None:
        """As :meth:`Volume.read_range_into`; ``file_size`` is checked against the stored bytes."""
        if file_size is not None:
            self._check_size(name, None if (data := self._get(name)) is None else len(data), file_size, 0)
        super().read_range_into(name, start, out)

    def read_bytes(self, name: str) -> bytes | None:
        return self._get(name)

    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
        """Store ``data`` as ``name`` in one step (readers see the old or the new bytes, whole).

        Raises:
            CheckpointExistsError: ``overwrite=False`` and ``name`` exists.
            TransferError: the location does not exist, or ``name`` is a directory.
        """
        where = self.url_of(name)
        try:
            self.store.write(self._key(name), data, exclusive=not overwrite)
        except FileExistsError as exc:
            raise CheckpointExistsError(f"{where} already exists and overwrite=False") from exc
        except OSError as exc:
            raise TransferError(f"publishing {where} failed: {exc}") from exc
        return False  # this process's memory, but the contract's read-back costs nothing here

    def delete(self, name: str) -> None:
        key = self._key(name)
        with self.store.lock:
            if key not in self.store.files and self.store.is_dir(key):
                raise TransferError(f"deleting {self.url_of(name)} failed: it is a directory")
            self.store.files.pop(key, None)

    def remove_if_empty(self) -> None:
        store, path = self.store, self.path
        below = f"{path}/"
        with store.lock:
            if (
                path
                and not any(p.startswith(below) for p in store.files)
                and not any(d.startswith(below) for d in store.dirs)
            ):
                store.dirs.discard(path)
