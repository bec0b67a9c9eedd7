"""Planning ranged reads: which byte ranges of which files a load fetches, and in what pieces.

A DCP load plan names, per data file, the ``(offset, length)`` of every item it needs. Fetching each
item alone costs a request per tensor; fetching whole files wastes bandwidth on partial loads. So the
ranges of one file are sorted and merged when the gap between them is small (the bytes skipped cost
less than another request's latency), widened to the file's checksum blocks so that every fetched
byte can be verified, and each merged range is fetched as parallel pieces of at most ``chunk_bytes``
(the same trade as s3transfer's ranged multipart downloads).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from uc_checkpoint.format.integrity import block_span

T = TypeVar("T")

#: Gap (bytes) below which two ranges of one file are fetched as one: about what an object store
#: serves in the time of one more request's first-byte latency (docs/benchmarks-design.md, "Range gap").
DEFAULT_GAP_BYTES = 1 << 20
#: Largest merged range (bytes), unless one item alone is larger or the spans share a checksum block.
DEFAULT_MAX_RANGE_BYTES = 64 << 20
#: Largest single GET (bytes); bigger ranges are fetched as parallel pieces.
DEFAULT_CHUNK_BYTES = 16 << 20
#: The smallest piece size a reader accepts (bytes): every piece is a request, and a range widened
#: to a 4 MiB checksum block in pieces of a few bytes would be millions of them.
MIN_CHUNK_BYTES = 64 << 10
#: A range's last piece shorter than ``chunk_bytes // TAIL_FOLD`` is read with the piece before it:
#: a data file is a few KiB of archive records longer than its tensors, and a GET of those few KiB
#: alone costs a whole request's latency (and doubled a load's GETs).
TAIL_FOLD = 4


@dataclass
class RangeRequest(Generic[T]):
    """Bytes ``[start, end)`` of file ``name`` and the items (opaque to this module) inside them."""

    name: str
    start: int
    end: int
    items: list[T] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def pieces(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """``[start, end)`` split into consecutive pieces of ``chunk_bytes``, starting at ``start``;
        the last piece is the rest, or, when the rest is under ``chunk_bytes //``
        :data:`TAIL_FOLD`, the piece before it grown by the rest (so a piece is at most 1.25x
        ``chunk_bytes``)."""
        bounds = list(range(self.start, self.end, chunk_bytes)) + [self.end]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] < chunk_bytes // TAIL_FOLD:
            del bounds[-2]
        return list(zip(bounds[:-1], bounds[1:]))


def plan_ranges(
    spans: Iterable[tuple[str, int, int, T]],
    *,
    file_sizes: dict[str, int],
    block_sizes: dict[str, int] | None = None,
    gap_bytes: int = DEFAULT_GAP_BYTES,
    max_range_bytes: int = DEFAULT_MAX_RANGE_BYTES,
) -> list[RangeRequest[T]]:
    """Merge item spans into range requests.

    Args:
        spans: ``(file name, offset, length, item)`` per item, offsets and lengths in bytes.
        file_sizes: size of each file in bytes (ranges are clipped to it; a span past the end is
            left as is so the fetch reports the file as truncated).
        block_sizes: checksum block size per file; ranges are widened to block boundaries.
        gap_bytes: merge two ranges when at most this many bytes lie between them.
        max_range_bytes: do not grow a merged range beyond this (one larger item stays whole,
            and spans that overlap once widened to checksum blocks are merged whatever the size).

    Returns:
        Requests sorted by file and offset; every item is in exactly one request that covers its
        span, and the requests of one file do not overlap (no byte is fetched twice).
    """
    by_file: dict[str, list[tuple[int, int, T]]] = {}
    for name, offset, length, item in spans:
        by_file.setdefault(name, []).append((offset, offset + length, item))
    blocks = block_sizes or {}
    out: list[RangeRequest[T]] = []
    for name in sorted(by_file):
        size = file_sizes.get(name)
        block = blocks.get(name, 0)
        current: RangeRequest[T] | None = None
        for lo, hi, item in sorted(by_file[name], key=lambda s: (s[0], s[1])):
            if block and size is not None and hi <= size:
                lo, hi = block_span(lo, hi, size, block)
            # Spans whose checksum blocks overlap are merged whatever the size: cut apart, the
            # block they share was fetched twice, and each cut cost a GET.
            if current is not None and (
                lo < current.end
                or (lo - current.end <= gap_bytes and max(hi, current.end) - current.start <= max_range_bytes)
            ):
                current.end = max(current.end, hi)
                current.items.append(item)
                continue
            current = RangeRequest(name, lo, hi, [item])
            out.append(current)
    return out


class ByteBudget:
    """Bytes that may be held in fetched-but-not-yet-consumed buffers at once.

    ``try_take`` always admits a request when nothing is held, so a single range larger than the
    budget still proceeds (alone).
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"byte budget must be >= 1, got {limit}")
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def try_take(self, nbytes: int) -> bool:
        with self._lock:
            if self.held and self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
