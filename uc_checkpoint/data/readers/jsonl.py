"""JSON Lines files: a shard is one ``.jsonl`` file (or ``.jsonl.gz``), a sample one line's JSON value.

Lines that are empty (no bytes, or only ``\\r``) are not samples; every other line must be one JSON
value.

``.jsonl`` (:class:`JsonlReader`, random access): an index of every sample's byte range (two
little-endian uint64 per line) is built once by one pass over the file and cached
(:class:`~uc_checkpoint.data.readers.base.IndexCache`: ``<file>.uc-index`` beside a writable local
file, else under the staging root), checked against the file's version stamp (a changed file's index
is rebuilt). Counting reads only the index; a range of lines is one slice of a memory map (local) or
ranged reads of just those bytes (remote).

``.jsonl.gz`` (:class:`GzipJsonlReader`, sequential): a gzip stream can only be decompressed from
the start of a member (RFC 1952), so random access is refused. The index records where each gzip
member starts (when it starts at a line start) and how many samples precede it; seeking to sample
``s`` decompresses from the start of the member holding it and discards the samples before ``s``.
That discarded work is bounded: :meth:`GzipJsonlReader.shards` refuses a file in which a member holds
more than ``max_skip`` samples (the tracker starts every worker's slice, and every resume, in the
middle of shards, so an unbounded skip would be a scan from the file's start). Write large shards as
many members (``gzip`` each block of lines and concatenate, as ``bgzip`` does) or uncompressed.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from uc_checkpoint.data.readers.base import ShardReader, ShardReaderOptions
from uc_checkpoint.volumes import Volume

if TYPE_CHECKING:
    from typing_extensions import Unpack

_SCAN_BLOCK = 8 << 20  # bytes per read while building an index


def _is_empty(line: bytes) -> bool:
    return line == b"" or line == b"\r"


def _within(lines: np.ndarray, size: int) -> bool:
    """Whether a line index can be that of a file of ``size`` bytes: non-empty lines in file order,
    each ending before the next starts (a newline between), the last inside the file."""
    if not lines.size:
        return True
    starts, ends = lines[:, 0], lines[:, 1]
    return bool(int(ends[-1]) <= size and (starts < ends).all() and (starts[1:] > ends[:-1]).all())


def _members_fit(members: np.ndarray, size: int) -> bool:
    """Whether a gzip member index can be that of a file of ``size`` bytes: it starts at ``(0, 0)``,
    its member offsets ascend inside the file, it ends with ``(size, total)``, and sample counts
    never decrease."""
    offsets, counts = members[:, 0], members[:, 1]
    return bool(
        offsets[0] == 0
        and counts[0] == 0
        and offsets[-2] <= offsets[-1] == size
        and (np.diff(offsets[:-1]) > 0).all()
        and (np.diff(counts) >= 0).all()
    )


class JsonlReader(ShardReader):
    """Lines of ``.jsonl`` files, parsed with :func:`json.loads` (see the module docs).

    Args:
        location, files, volume_options, index_dir: see :class:`~uc_checkpoint.data.readers.base.ShardReader`.
        max_request_bytes: bytes per ranged read of a remote file at most (whole lines).

    Raises:
        DataFormatError: a line is not JSON (the message names the file, sample and bytes).
    """

    suffixes = (".jsonl",)
    random_access = True
    _kind = "jsonl-lines-v1"

    def __init__(
        self,
        location: str | os.PathLike[str] | Volume,
        *,
        max_request_bytes: int = 8 << 20,
        **options: Unpack[ShardReaderOptions],
    ) -> None:
        super().__init__(location, **options)
        self.max_request_bytes = max_request_bytes

    def _count(self, name: str, size: int, version: str) -> int:
        return len(self._lines(name, size, version))

    def _lines(self, name: str, size: int | None = None, version: str | None = None) -> np.ndarray:
        """``(samples, 2)`` uint64: each sample line's byte range ``[start, end)`` (no newline)."""
        return self.cached_table(name, self._kind, "<u8", 2, self._scan, size, version, fits=_within)

    def _scan(self, name: str, size: int) -> np.ndarray:
        """One pass over the file: the byte range of every non-empty line."""
        newlines: list[np.ndarray] = []
        with self.open_file(name, size, buffer_size=_SCAN_BLOCK) as f:
            pos = 0
            while pos < size:
                block = f.read(min(_SCAN_BLOCK, size - pos))
                if not block:
                    raise self.malformed(name, f"ended at byte {pos} while indexed, {size} expected")
                newlines.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10).astype(np.int64) + pos)
                pos += len(block)
        nl = np.concatenate(newlines) if newlines else np.zeros(0, dtype=np.int64)
        starts = np.concatenate(([0], nl + 1))
        ends = np.concatenate((nl, [size]))
        lengths = ends - starts
        keep = lengths > 0
        short = np.flatnonzero(lengths == 1)  # a lone "\r" is an empty line too
        if short.size:
            with self.open_file(name, size) as f:
                for i in short.tolist():
                    f.seek(int(starts[i]))
                    if f.read(1) == b"\r":
                        keep[i] = False
        return np.stack((starts[keep], ends[keep]), axis=1).astype(np.uint64)

    def _parse(self, name: str, index: int, line: bytes | memoryview, where: tuple[int, int]) -> Any:
        try:
            return json.loads(bytes(line))
        except (ValueError, RecursionError) as exc:
            raise self.malformed(name, f"sample {index} (bytes {where[0]}-{where[1] - 1}) is not JSON: {exc}") from None

    def _read_range(self, name: str, start: int, end: int) -> Iterator[Any]:
        lines = self._lines(name)
        if end > len(lines):
            raise self.malformed(name, f"has {len(lines)} samples, {end} asked")
        if self.local_path(name) is not None:
            data = self.mapped(name)
            if lines.size and int(lines[-1, 1]) > len(data):
                raise self.malformed(name, "is shorter than its index (truncated since it was indexed?)")
            for i in range(start, end):
                a, b = int(lines[i, 0]), int(lines[i, 1])
                yield self._parse(name, i, data[a:b], (a, b))
            return
        i = start
        while i < end:
            first = int(lines[i, 0])
            # whole lines up to max_request_bytes (at least one)
            last = int(np.searchsorted(lines[i:end, 1], first + self.max_request_bytes, side="right")) + i
            last = max(last, i + 1)
            block = self.read_bytes(name, first, int(lines[last - 1, 1]))
            for j in range(i, last):
                a, b = int(lines[j, 0]), int(lines[j, 1])
                yield self._parse(name, j, block[a - first : b - first], (a, b))
            i = last


class GzipJsonlReader(ShardReader):
    """Lines of ``.jsonl.gz`` files, read sequentially from the gzip member holding the first asked
    sample (see the module docs; no :meth:`read_indices`).

    Args:
        location, files, volume_options, index_dir: see :class:`~uc_checkpoint.data.readers.base.ShardReader`.
        max_skip: samples a seek may decompress and discard at most (the most samples one gzip
            member of a shard may hold).

    Raises:
        DataFormatError: a member holds more than ``max_skip`` samples (from :meth:`shards`); not
            gzip, truncated, or a line is not JSON. The message names the file.
    """

    suffixes = (".jsonl.gz",)
    random_access = False
    _kind = "jsonl-gzip-members-v1"

    def __init__(
        self,
        location: str | os.PathLike[str] | Volume,
        *,
        max_skip: int = 10_000,
        **options: Unpack[ShardReaderOptions],
    ) -> None:
        super().__init__(location, **options)
        self.max_skip = max_skip

    def _count(self, name: str, size: int, version: str) -> int:
        members = self._members(name, size, version)
        gaps = np.diff(members[:, 1])
        if gaps.size and int(gaps.max()) > self.max_skip:
            at = int(np.argmax(gaps))
            raise self.malformed(
                name,
                f"its gzip member at byte {int(members[at, 0])} holds {int(gaps[at])} samples, more than "
                f"max_skip={self.max_skip}: a seek into it would decompress them all; write it as gzip members "
                "of fewer lines each (or raise max_skip, or store it as .jsonl)",
            )
        return int(members[-1, 1])

    def _members(self, name: str, size: int | None = None, version: str | None = None) -> np.ndarray:
        """``(points + 1, 2)`` int64: ``(compressed offset, samples before it)`` of each member that
        starts at a line start, then ``(file size, total samples)``."""
        return self.cached_table(name, self._kind, "<i8", 2, self._scan, size, version, min_rows=2, fits=_members_fit)

    def _scan(self, name: str, size: int) -> np.ndarray:
        points: list[tuple[int, int]] = [(0, 0)]
        count = 0
        for member_end, at_line_start, samples in self._walk(name, size, 0, count_only=True):
            count = samples
            if member_end < size and at_line_start:
                points.append((member_end, count))
        points.append((size, count))
        return np.asarray(points, dtype=np.int64)

    def _walk(self, name: str, size: int, offset: int, *, count_only: bool) -> Iterator[Any]:
        """Decompress members from ``offset``: with ``count_only``, yield ``(member end, ends at a
        line start, samples so far)`` per member; else yield each sample line's bytes."""
        samples = 0
        pending = b""
        block = 16 << 10  # read blocks grow from 16 KiB to 1 MiB: a seek into a small member reads little
        with self.open_file(name, size, buffer_size=block) as f:
            f.seek(offset)
            pos = offset
            unzip = zlib.decompressobj(wbits=31)
            fed = False  # whether the current member got any bytes
            data = b""
            while True:
                if not data:
                    data = f.read(block)
                    block = min(block * 2, 1 << 20)
                    if not data:
                        if fed and not unzip.eof:
                            raise self.malformed(name, f"truncated gzip stream (ends inside a member at byte {pos})")
                        break
                if not fed and pos > 0:  # zero bytes after a member are padding (Python's gzip skips them too)
                    padded = data.lstrip(b"\0")
                    pos += len(data) - len(padded)
                    data = padded
                    if not data:
                        continue
                try:
                    text = unzip.decompress(data)
                except zlib.error as exc:
                    raise self.malformed(name, f"not valid gzip at byte {pos}: {exc}") from None
                fed = True
                pos += len(data) - len(unzip.unused_data)
                data = unzip.unused_data
                lines = (pending + text).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if not _is_empty(line):
                        samples += 1
                        if not count_only:
                            yield line
                if unzip.eof:
                    if count_only:
                        yield pos, pending == b"", samples
                    unzip = zlib.decompressobj(wbits=31)
                    fed = False
            if not _is_empty(pending):
                yield (size, True, samples + 1) if count_only else pending

    def _read_range(self, name: str, start: int, end: int) -> Iterator[Any]:
        members = self._members(name)
        total = int(members[-1, 1])
        if end > total:
            raise self.malformed(name, f"has {total} samples, {end} asked")
        point = int(np.searchsorted(members[:-1, 1], start, side="right")) - 1
        offset, before = int(members[point, 0]), int(members[point, 1])
        stat_size = int(members[-1, 0])
        index = before
        for line in self._walk(name, stat_size, offset, count_only=False):
            if index >= end:
                break
            if index >= start:
                try:
                    yield json.loads(line)
                except (ValueError, RecursionError) as exc:
                    raise self.malformed(name, f"sample {index} is not JSON: {exc}") from None
            index += 1


__all__ = ["GzipJsonlReader", "JsonlReader"]
