"""Resources that belong to one process: clients, transfer managers, open files, caches.

A value built in one process must not be used in another. A child forked from this process
inherits the object but not the threads behind it (a transfer manager's workers), shares its
connections and file positions with the parent, and may inherit a lock that a thread of the parent
held at the fork, held forever. A copy sent to another process by pickling (DCP's PROCESS mode,
spawned DataLoader workers) would carry a client or open files that cannot cross. So such a value
is kept in a :class:`ProcessLocal`: built on first use in each process, built again in a forked
child, and never pickled (an unpickled or deep-copied one is empty and builds its own), as fsspec's
cached filesystems check the pid once (``fsspec.spec._Cached``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ProcessLocal(Generic[T]):
    """One value per process, built lazily by the ``build`` given to :meth:`get`.

    Thread-safe: threads racing to the first :meth:`get` of a process build the value once. The
    lock of each process is its own (a lock of the parent, perhaps held by one of its threads at the
    fork, is never waited on in the child). Pickles, and deep-copies, as an empty one.
    """

    def __init__(self) -> None:
        # (pid, value) of the process that built it; read and replaced as one attribute.
        self._built: tuple[int, T] | None = None
        # pid -> the lock that process builds under (dict.setdefault: racing threads get one lock).
        self._locks: dict[int, threading.Lock] = {}

    def get(self, build: Callable[[], T]) -> T:
        """This process's value: built now by ``build()`` if this process has none yet (first use,
        a forked child, an unpickled copy). An exception of ``build`` passes, and the next call
        tries again."""
        pid = os.getpid()
        built = self._built
        if built is not None and built[0] == pid:
            return built[1]
        with self._locks.setdefault(pid, threading.Lock()):
            built = self._built
            if built is not None and built[0] == pid:
                return built[1]
            for other in [p for p in self._locks if p != pid]:
                self._locks.pop(other, None)  # a parent's lock: no thread of this process uses it
            value = build()
            self._built = (pid, value)
            return value

    def peek(self) -> T | None:
        """This process's value if it was built here, else None (nothing is built)."""
        built = self._built
        return built[1] if built is not None and built[0] == os.getpid() else None

    def take(self) -> T | None:
        """This process's value (None if none was built here), forgotten: the next :meth:`get`
        builds another. For closing it; a value built in another process is dropped, not returned
        (it is that process's to close)."""
        pid = os.getpid()
        with self._locks.setdefault(pid, threading.Lock()):
            built, self._built = self._built, None
        return built[1] if built is not None and built[0] == pid else None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __repr__(self) -> str:
        built = self.peek()
        return f"ProcessLocal({'empty' if built is None else type(built).__name__})"


__all__ = ["ProcessLocal"]
