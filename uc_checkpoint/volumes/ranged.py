"""A read-only, seekable binary stream over ranged reads, for libraries that want a file object
(``tarfile``, ``zipfile``, pyarrow, ``torch.load``) where the bytes come from a store's ranged GETs
or from memory.

The stream keeps its own position (streams over one source are independent of each other) and ends
at the ``size`` given, whatever the source holds past it. Interface: Python's :class:`io.RawIOBase`
(``readinto`` is the primitive; wrap the stream in :class:`io.BufferedReader` for many small reads).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

__all__ = ["RangedStream"]


class RangedStream(io.RawIOBase):
    """Bytes ``[0, size)`` of a source read by ``read_range(start, end)`` (bytes ``[start, end)``,
    ``end <= size``; a shorter answer is a short read). Each ``readinto`` is one ``read_range`` of at
    most what was asked; :meth:`readall` is one ``read_range`` of the rest.

    Args:
        read_range: reads bytes ``[start, end)`` of the source (a ranged GET, a slice of memory).
        size: the source's size in bytes; the stream ends there.

    Errors are those of ``read_range``.
    """

    def __init__(self, read_range: Callable[[int, int], bytes | memoryview], size: int) -> None:
        super().__init__()
        self._read_range = read_range
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        want = min(len(out), self._size - self._pos)
        if want <= 0:
            return 0
        data = self._read_range(self._pos, self._pos + want)
        out[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        """The rest of the stream in one ``read_range`` (the default would read 8 KiB per call)."""
        if self._pos >= self._size:
            return b""
        data = bytes(self._read_range(self._pos, self._size))
        self._pos += len(data)
        return data

    def size(self) -> int:
        """The stream's size in bytes (pyarrow asks)."""
        return self._size
