"""Checksums of checkpoint files: whole-file CRC-32, per-block CRC-32 for ranged reads, and S3's
checksum forms.

Every data file gets, in one pass over its bytes:

- the CRC-32 (zlib polynomial, the same as S3's ``CRC32`` checksum) of the whole file, which
  verifies whole-file downloads;
- the CRC-32 of each aligned block of :data:`VERIFY_BLOCK_SIZE` bytes (the last one shorter), which
  verifies ranged reads: a reader widens each range to block boundaries and checks every block it
  fetched. The same idea as HDFS's per-chunk checksums (``dfs.bytes-per-checksum``), with larger
  blocks because reads here are whole tensors;
- optionally the CRC-32 of each upload part, from which S3's *composite* multipart checksum
  (CRC-32 of the concatenated big-endian part CRCs, base64, see the S3 user guide "Checking object
  integrity") is derived to compare with what the store reports.

Only the bytes between consecutive block or part boundaries are run through :func:`crc32`, once;
the block, part and whole-file CRC-32s are composed from those with :func:`crc32_combine` (zlib's
``crc32_combine``, which Python's zlib does not expose), so a file is checksummed in one pass, not
one per kind. :func:`crc32` is Intel ISA-L's (the ``isal`` package: carry-less multiplication, an
order of magnitude faster than zlib's; docs/benchmarks-design.md, "CRC-32"), zlib's where ``isal``
does not install; both give the same results and release the GIL on large buffers.
"""

from __future__ import annotations

import base64
import functools
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from uc_checkpoint.errors import CorruptCheckpointError


def _pick_crc32() -> Callable[[Any, int], int]:
    try:
        from isal import isal_zlib
    except ImportError:  # no wheel for this platform: zlib's, same results, more CPU
        return zlib.crc32
    return isal_zlib.crc32


_crc32 = _pick_crc32()


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32 of ``data`` continuing from ``value``: exactly ``zlib.crc32`` (S3's ``CRC32``), computed
    by ISA-L when ``isal`` is installed."""
    return _crc32(data, value)


#: Bytes covered by one block checksum (4 MiB). A ranged read fetches at most one block more on
#: each side than it needs; a 100 GB checkpoint carries 25k block checksums (100 KB in .metadata).
VERIFY_BLOCK_SIZE = 4 << 20

#: Bytes per read/write when a file is streamed through Python.
CHUNK_SIZE = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """What landed on a volume: a file's name, size in bytes and checksums.

    Attributes:
        name: the file's name at its checkpoint location.
        size: bytes.
        crc32: CRC-32 of the whole file as 8 lowercase hex digits.
        block_size: bytes per block of ``block_crc32`` (0 when there are none).
        block_crc32: CRC-32 of each ``block_size`` block, packed as big-endian uint32 (4 bytes per
            block, ``ceil(size / block_size)`` blocks).
    """

    name: str
    size: int
    crc32: str
    block_size: int = 0
    block_crc32: bytes = b""


# ---- crc32_combine: the CRC-32 of A+B from crc(A), crc(B) and len(B) -----------------------------
# CRC-32 is linear over GF(2): appending n zero bytes to A maps crc(A) through a fixed 32x32 bit
# matrix, so crc(A+B) = M(len B) . crc(A) xor crc(B). The construction is zlib's (crc32.c,
# gf2_matrix_times / gf2_matrix_square); matrices are lists of 32 column bitmasks.
_CRC32_POLY = 0xEDB88320  # reflected


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_product(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_times(a, column) for column in b)


@functools.cache
def _zeros_power(k: int) -> tuple[int, ...]:
    """The operator that appends 2**k zero bytes."""
    if k == 0:
        one_bit = (_CRC32_POLY, *(1 << n for n in range(31)))
        op = one_bit
        for _ in range(3):  # 2, 4, then 8 zero bits: one zero byte
            op = _gf2_product(op, op)
        return op
    half = _zeros_power(k - 1)
    return _gf2_product(half, half)


@functools.lru_cache(maxsize=256)
def _zeros_operator(length: int) -> tuple[int, ...]:
    """The operator that appends ``length`` zero bytes (``length`` > 0)."""
    op: tuple[int, ...] | None = None
    k = 0
    while length:
        if length & 1:
            op = _zeros_power(k) if op is None else _gf2_product(_zeros_power(k), op)
        length >>= 1
        k += 1
    assert op is not None
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` given ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``
    in bytes (zlib's ``crc32_combine``). Costs microseconds once an operator for ``len2`` is cached."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


class Digest:
    """Running checksums of one byte stream: whole, per block and (optionally) per part.

    Args:
        block_size: bytes per block checksum.
        part_size: bytes per upload part, or ``None`` to skip part checksums.
    """

    def __init__(self, block_size: int = VERIFY_BLOCK_SIZE, part_size: int | None = None) -> None:
        self.size = 0
        self._crc = 0
        self._block_size = block_size
        self._block_crc = 0
        self._blocks: list[int] = []
        self._part_size = part_size
        self._part_crc = 0
        self.part_crc32: list[int] = []
        # The span since the last block or part boundary: the only bytes checksummed, once each.
        self._span_crc = 0
        self._span_len = 0
        self._closed = False

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        n = len(view)
        while pos < n:
            # Split at the next block or part boundary so each span lies inside one block and part.
            step = n - pos
            in_block = self.size % self._block_size
            step = min(step, self._block_size - in_block)
            if self._part_size:
                step = min(step, self._part_size - self.size % self._part_size)
            self._span_crc = crc32(view[pos : pos + step], self._span_crc)
            self._span_len += step
            self.size += step
            pos += step
            at_block = self.size % self._block_size == 0
            at_part = self._part_size is not None and self.size % self._part_size == 0
            if at_block or at_part:
                self._end_span(at_block, at_part)

    def _end_span(self, at_block: bool, at_part: bool) -> None:
        crc, length = self._span_crc, self._span_len
        self._span_crc = self._span_len = 0
        self._crc = crc32_combine(self._crc, crc, length)
        self._block_crc = crc32_combine(self._block_crc, crc, length)
        if self._part_size:
            self._part_crc = crc32_combine(self._part_crc, crc, length)
        if at_block:
            self._blocks.append(self._block_crc)
            self._block_crc = 0
        if at_part:
            self.part_crc32.append(self._part_crc)
            self._part_crc = 0

    def close(self) -> None:
        """Account for the trailing partial block and part; no more updates after this."""
        if self._closed:
            return
        self._closed = True
        if self._span_len:
            self._end_span(False, False)
        if self.size % self._block_size:
            self._blocks.append(self._block_crc)
            self._block_crc = 0
        if self._part_size and self.size % self._part_size:
            self.part_crc32.append(self._part_crc)
            self._part_crc = 0

    def record(self, name: str) -> FileRecord:
        """The :class:`FileRecord` of everything seen so far (call once, at the end)."""
        self.close()
        return FileRecord(
            name=name,
            size=self.size,
            crc32=f"{self._crc:08x}",
            block_size=self._block_size,
            block_crc32=struct.pack(f">{len(self._blocks)}I", *self._blocks),
        )


def copy_stream(src: BinaryIO, dst: BinaryIO | None, digest: Digest, limit: int | None = None) -> int:
    """Copy ``src`` to ``dst`` (or just read it when ``dst`` is ``None``) in :data:`CHUNK_SIZE`
    pieces, feeding ``digest``; return the number of bytes copied. With ``limit``, stop after that
    many bytes (a source that grew, or never ends, is not read past what was expected)."""
    buf = bytearray(CHUNK_SIZE)
    view = memoryview(buf)
    total = 0
    while True:
        want = CHUNK_SIZE if limit is None else min(CHUNK_SIZE, limit - total)
        n = src.readinto(view[:want]) if want > 0 else 0  # type: ignore[attr-defined]
        if not n:
            return total
        chunk = view[:n]
        digest.update(chunk)
        if dst is not None:
            dst.write(chunk)
        total += n


def digest_file(path: Path, part_size: int | None = None) -> Digest:
    """Checksums of a local file, read once in :data:`CHUNK_SIZE` pieces."""
    digest = Digest(part_size=part_size)
    with open(path, "rb") as f:
        copy_stream(f, None, digest)
    digest.close()
    return digest


def crc32_base64(value: int) -> str:
    """A CRC-32 as S3 writes it in ``x-amz-checksum-crc32``: base64 of 4 big-endian bytes."""
    return base64.b64encode(struct.pack(">I", value)).decode("ascii")


def composite_crc32_base64(part_crcs: Iterable[int]) -> str:
    """S3's composite checksum of a multipart upload: CRC-32 of the parts' big-endian CRC-32s."""
    parts = list(part_crcs)
    return crc32_base64(crc32(struct.pack(f">{len(parts)}I", *parts)))


def block_span(start: int, end: int, size: int, block_size: int) -> tuple[int, int]:
    """Widen the byte range ``[start, end)`` of a ``size``-byte file to block boundaries."""
    first = (start // block_size) * block_size
    last = min(size, -(-end // block_size) * block_size)
    return first, last


def verify_blocks(data: memoryview | bytes | Sequence[memoryview], start: int, record: FileRecord, where: str) -> None:
    """Check the block-aligned bytes ``data`` read at offset ``start`` of ``record``'s file:
    one buffer, or several holding consecutive bytes (a range received partly into its tensors).

    Raises:
        CorruptCheckpointError: a block fails its checksum (the message names ``where`` and the
            byte range of the block).
    """
    bs = record.block_size
    if not bs or not record.block_crc32:
        return
    if start % bs:
        raise ValueError(f"range start {start} is not aligned to {bs}-byte blocks")
    parts = [data] if isinstance(data, (bytes, memoryview)) else list(data)
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    total = sum(map(len, views))
    expected = struct.unpack(f">{len(record.block_crc32) // 4}I", record.block_crc32)
    at, offset = 0, 0  # the view the next byte is in, and where in it
    for pos in range(0, total, bs):
        n = min(bs, total - pos)
        crc, left = 0, n
        while left:
            view = views[at]
            take = min(left, len(view) - offset)
            crc = crc32(view[offset : offset + take], crc)
            left -= take
            offset += take
            if offset == len(view):
                at, offset = at + 1, 0
        index = (start + pos) // bs
        if index >= len(expected) or crc != expected[index]:
            lo = start + pos
            raise CorruptCheckpointError(f"{where} fails its checksum in bytes {lo}-{lo + n - 1} (block {index})")
