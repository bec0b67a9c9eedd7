"""Fetch pipelines of a load: whole files into staging, or byte ranges into memory, verified, and
handed to a consumer as each request completes.

Each request (one file, or one merged byte range split into parallel pieces) is a pipeline object
holding its own state, as in torchsnapshot's ``scheduler.py`` (``_ReadPipeline``: read, then
consume); :func:`fetch_files` and :func:`fetch_ranges` only start requests (the pieces of
several ranges queued in turn, so the workers read different files at once), enforce the memory
budget and hand finished requests to the consumer in the order they complete. The consumer runs on
the calling thread, so it can use that thread's state (a DCP load's session).

Both modes share one failure path: the tasks of a request run in a
:class:`~uc_checkpoint.engine.transfer.TransferGroup` on a bounded
:class:`~uc_checkpoint.engine.transfer.TransferPool` (s3transfer's bounded executor and coordinator), whose
``results`` raises the first failure, a foreign error wrapped once into ``TransferError("reading
<file> failed: ...")``. A failure ends the whole fetch: requests not yet started are cancelled,
running ones are waited for, and the volume's clients are closed.

Nothing here knows DCP: a request's items are opaque (see :class:`~uc_checkpoint.engine.ranges.RangeRequest`).
"""

from __future__ import annotations

import collections
import logging
import mmap
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from uc_checkpoint.engine.ranges import ByteBudget, RangeRequest
from uc_checkpoint.engine.staging_dir import create_staging_dir
from uc_checkpoint.engine.transfer import TransferGroup, TransferPool
from uc_checkpoint.errors import CorruptCheckpointError
from uc_checkpoint.format.integrity import FileRecord, verify_blocks
from uc_checkpoint.observability import TransferRecord
from uc_checkpoint.volumes import Volume

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class FetchStats:
    """What a fetch did: ``files`` distinct files and ``bytes`` bytes read from the volume in
    ``seconds`` (consuming included: it overlaps the reads), with ``retries`` requests retried by the
    volume's client."""

    files: int
    bytes: int
    seconds: float
    retries: int

    def record(self, location: str, rank: int) -> TransferRecord:
        """This fetch as a load's :class:`~uc_checkpoint.observability.TransferRecord` (reads and
        deserialisation overlap, so the transfer time is the whole read step)."""
        return TransferRecord(
            op="load",
            location=location,
            rank=rank,
            bytes=self.bytes,
            files=self.files,
            total_s=self.seconds,
            staging_s=0.0,
            transfer_s=self.seconds,
            retries=self.retries,
        )


class _Pipeline(Generic[R]):
    """One request's transfers (a :class:`TransferGroup` of its own) and the signal that it is ready.

    The request is put on ``ready`` once, from a worker: when every task has succeeded, or as soon as
    one has failed (its other tasks then skip their reads; :meth:`wait` cancels those not started).
    ``TransferGroup`` itself offers no per-request completion hook, hence the counting here.
    """

    def __init__(self, pool: TransferPool, what: str, ready: queue.SimpleQueue[Any]) -> None:
        self._group: TransferGroup[R | None] = TransferGroup(pool, what)
        self._ready = ready
        self._lock = threading.Lock()
        self._left = 0
        self._signalled = False
        self._unsubmitted: collections.deque[tuple[Callable[..., R], tuple[object, ...]]] = collections.deque()
        self.failed = False

    def _prepare(self, tasks: Sequence[tuple[Callable[..., R], tuple[object, ...]]]) -> None:
        """Count ``tasks`` as this request's, to be submitted by :meth:`submit_next`."""
        self._left = len(tasks)
        self._unsubmitted = collections.deque(tasks)
        if not tasks:
            self._signal()

    def _start(self, tasks: Sequence[tuple[Callable[..., R], tuple[object, ...]]]) -> None:
        self._prepare(tasks)
        while self.unsubmitted:
            self.submit_next()

    @property
    def unsubmitted(self) -> int:
        """Tasks prepared and not yet submitted (the request is ready only once they have run)."""
        return len(self._unsubmitted)

    def submit_next(self) -> None:
        """Submit the next prepared task (blocks while the pool is full)."""
        fn, args = self._unsubmitted.popleft()
        self._group.submit(self._run, fn, *args)

    def _run(self, fn: Callable[..., R], *args: object) -> R | None:
        if self.failed:  # another task of this request failed: its bytes are of no use
            return None
        try:
            result = fn(*args)
        except BaseException:
            self.failed = True
            self._signal()
            raise
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._signal()
        return result

    def _signal(self) -> None:
        with self._lock:
            if self._signalled:
                return
            self._signalled = True
        self._ready.put(self)

    def wait(self) -> list[R | None]:
        """The tasks' results, in submission order (None only from tasks that skipped their work
        after another failed, and then this raises).

        Raises:
            UCCheckpointError: the first task's failure (foreign errors as ``TransferError``).
        """
        return self._group.results()


class FileFetch(_Pipeline[FileRecord]):
    """Download one file whole into a staging directory and check it against its record.

    Args:
        volume: where the file is.
        name: its name at the checkpoint location.
        dest: the local path to write.
        expected: the manifest's record (its size is checked before a byte is read; its CRC-32
            afterwards, when ``verify``), or None for a file without one.
        min_size: bytes the items need (checked, and read, when there is no record).
        verify: compare the whole file's CRC-32 with ``expected``.
    """

    def __init__(
        self,
        pool: TransferPool,
        ready: queue.SimpleQueue[FileFetch],
        volume: Volume,
        name: str,
        dest: Path,
        *,
        expected: FileRecord | None,
        min_size: int,
        verify: bool,
    ) -> None:
        super().__init__(pool, f"reading {volume.url_of(name)} failed", ready)
        self.volume = volume
        self.name = name
        self.dest = dest
        self.expected = expected
        self.min_size = min_size
        self.verify = verify

    def start(self) -> None:
        self._start([(self._download, ())])

    def _download(self) -> FileRecord:
        # Sizes are checked by download_file before a byte is read, and nothing past them is read;
        # the content is checked here.
        expected = self.expected
        record = self.volume.download_file(
            self.name,
            self.dest,
            expected_size=None if expected is None else expected.size,
            min_size=self.min_size,
        )
        if expected is not None and self.verify and record.crc32 != expected.crc32:
            raise CorruptCheckpointError(
                f"{self.volume.url_of(record.name)} fails its checksum: crc32 {record.crc32}, recorded {expected.crc32}"
            )
        return record

    def result(self) -> FileRecord:
        """The downloaded file's record (raises the download's error)."""
        (record,) = self.wait()
        assert record is not None
        return record


class RangeFetch(_Pipeline[None], Generic[T]):
    """Fetch one :class:`~uc_checkpoint.engine.ranges.RangeRequest` as parallel pieces of at most
    ``chunk_bytes`` into one buffer, then check the checksum blocks it covers.

    Args:
        volume: where the file is.
        request: the byte range and its (opaque) items.
        chunk_bytes: largest single read.
        record: the file's record, whose block CRC-32s verify the range (None: not verified; the
            range must then be block-aligned, see :func:`~uc_checkpoint.engine.ranges.plan_ranges`).
        in_place: ``(lo, hi, into)`` spans of the range, sorted and apart, whose bytes are received
            into ``into`` (``hi - lo`` writable bytes, e.g. a tensor's memory) instead of the
            buffer; they are verified there like the rest. The buffer's bytes at those spans are
            left as they were.
    """

    def __init__(
        self,
        pool: TransferPool,
        ready: queue.SimpleQueue[RangeFetch[T]],
        volume: Volume,
        request: RangeRequest[T],
        *,
        chunk_bytes: int,
        record: FileRecord | None,
        in_place: Sequence[tuple[int, int, memoryview]] = (),
    ) -> None:
        super().__init__(pool, f"reading {volume.url_of(request.name)} failed", ready)
        self.volume = volume
        self.request = request
        self.chunk_bytes = chunk_bytes
        self.record = record
        self.in_place = list(in_place)
        self._buf = memoryview(bytearray(0))

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` file offsets of the reads this request is fetched in."""
        return self.request.pieces(self.chunk_bytes)

    def begin(self, buffer: memoryview | None = None) -> None:
        """Prepare every piece, each to be received into its place in ``buffer``
        (``request.nbytes`` writable bytes; default: new memory); :meth:`submit_next` queues them
        one at a time, so the pieces of several ranges can be interleaved."""
        self._buf = buffer if buffer is not None else _new_buffer(self.request.nbytes)
        self._prepare([(self._read_piece, piece) for piece in self.pieces])

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the range that go into its buffer (not received in place)."""
        return self.request.nbytes - sum(hi - lo for lo, hi, _ in self.in_place)

    def _views(self, lo: int, hi: int) -> list[memoryview]:
        """Where file bytes ``[lo, hi)`` are received, in order: the buffer, and the spans received
        in place."""
        start, out, pos = self.request.start, [], lo
        for a, b, into in self.in_place:
            if b <= pos:
                continue
            if a >= hi:
                break
            if pos < a:
                out.append(self._buf[pos - start : a - start])
                pos = a
            end = min(b, hi)
            out.append(into[pos - a : end - a])
            pos = end
        if pos < hi:
            out.append(self._buf[pos - start : hi - start])
        return out

    def _read_piece(self, lo: int, hi: int) -> None:
        views = self._views(lo, hi)
        size = self.record.size if self.record is not None else None
        self.volume.read_range_into(self.request.name, lo, views[0] if len(views) == 1 else views, file_size=size)
        # The blocks this piece holds whole are checked here, on the worker that received them:
        # the bytes are still in cache, and the checks of a load's pieces run side by side instead
        # of one after another on the consumer's thread.
        span = self._whole_blocks(lo, hi)
        if span is not None:
            self._verify(*span)

    def _verify(self, lo: int, hi: int) -> None:
        assert self.record is not None
        verify_blocks(self._views(lo, hi), lo, self.record, self.volume.url_of(self.request.name))

    def _whole_blocks(self, lo: int, hi: int) -> tuple[int, int] | None:
        """The span of the checksum blocks that piece ``[lo, hi)`` holds whole (None: none, or the
        range is not verified piece by piece: no record, or a start off the block grid, which
        :meth:`result` reports)."""
        record = self.record
        if record is None or not record.block_size or not record.block_crc32:
            return None
        bs = record.block_size
        if self.request.start % bs:
            return None
        a = -(-lo // bs) * bs
        b = hi if hi == self.request.end else hi // bs * bs  # a range ends on the grid or at the file's end
        return (a, b) if a < b else None

    def result(self) -> memoryview:
        """The range's buffer (its bytes but those received in place), every byte verified against
        the record's block checksums.

        Raises:
            CorruptCheckpointError: a block fails its checksum (the message names the file and the
                block's bytes), or the volume found the file missing or short.
            TransferError: a read failed for another reason.
        """
        self.wait()
        if self.record is not None:
            for lo, hi in self._blocks_left():
                self._verify(lo, hi)
        return self._buf

    def _blocks_left(self) -> list[tuple[int, int]]:
        """The spans no piece verified whole: blocks cut by a piece boundary (pieces smaller than a
        block, or off its grid), or the whole range when it is not verified piece by piece."""
        req, record = self.request, self.record
        assert record is not None
        spans = [s for s in (self._whole_blocks(lo, hi) for lo, hi in self.pieces) if s is not None]
        if not spans:
            return [(req.start, req.end)] if record.block_size and record.block_crc32 else []
        bs, left, pos = record.block_size, [], req.start
        for a, b in [*spans, (req.end, req.end)]:
            if pos < a:  # [pos, a) lies on the block grid: pos and a are both boundaries or the end
                left.append((pos, a))
            pos = max(pos, b)
        assert all(lo % bs == 0 for lo, _ in left)
        return left


def fetch_files(
    volume: Volume,
    names: Iterable[str],
    staging: Path,
    consume: Callable[[str, Path], None],
    *,
    records: Mapping[str, FileRecord],
    min_sizes: Mapping[str, int],
    verify: bool,
    workers: int,
    thread_name: str = "uc-download",
) -> FetchStats:
    """Download each file whole into ``staging`` (created, and removed at the end; a file in a
    spread prefix, ``<spread>/<name>``, into a sub-directory of the same name), ``workers`` at a
    time, and call ``consume(name, local_path)`` on this thread for each as soon as it has arrived
    and been verified; each local file is deleted once consumed.

    Args:
        records: the manifest's record per name (sizes always checked; CRC-32s when ``verify``).
        min_sizes: bytes per name the items need (for files without a record).

    Raises:
        StagingError: ``staging`` cannot be created (before anything is fetched).
        CorruptCheckpointError: a file is missing, has the wrong size, or fails its checksum.
        TransferError: a download failed for another reason.
        Whatever ``consume`` raises. On any error the other downloads are cancelled or waited for.
    """
    started, retries = time.perf_counter(), volume.retries
    held = create_staging_dir(staging)
    cache = held.path
    ready: queue.SimpleQueue[FileFetch] = queue.SimpleQueue()
    pool = TransferPool(workers, name=thread_name)
    outstanding = 0
    nbytes = 0
    try:
        for name in dict.fromkeys(names):
            if "/" in name:  # a spread prefix's file (names are checked plain otherwise, metadata_io)
                (cache / name).parent.mkdir(exist_ok=True)
            fetch = FileFetch(
                pool,
                ready,
                volume,
                name,
                cache / name,
                expected=records.get(name),
                min_size=min_sizes.get(name, 0),
                verify=verify,
            )
            fetch.start()
            outstanding += 1
        nfiles = outstanding
        while outstanding:
            done = ready.get()
            outstanding -= 1
            nbytes += done.result().size
            consume(done.name, done.dest)
            done.dest.unlink(missing_ok=True)
    finally:
        pool.shutdown(cancel_pending=True)
        volume.close()  # its transfer threads end here; the next use makes new ones
        held.remove()
    return FetchStats(nfiles, nbytes, time.perf_counter() - started, volume.retries - retries)


def _new_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of fresh writable memory, not yet touched: an anonymous map. ``bytearray(n)``
    zero-fills its memory on the consumer's thread with the GIL held, during which no further read
    is queued (docs/benchmarks-design.md, "Read buffers"); a map's pages are zeroed by the kernel when the
    worker's receive first writes them, on the worker, without the GIL."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]


class _Buffers:
    """Range buffers given back after their range was consumed, received into again by a later
    range: fresh memory costs the kernel a page fault and a zeroing per 4 KiB page on first touch,
    about as much CPU as copying the bytes. Used from one thread.

    Bounds: the buffers lent out and those kept together stay within ``limit`` bytes (a buffer
    given back is kept only while they do), and a kept buffer serves a range of at least
    :data:`REUSE_FILL` of its size, so what is lent exceeds the ranges' own bytes by a quarter
    at most.
    """

    #: A kept buffer serves a request of at least this fraction of its size.
    REUSE_FILL = 0.8

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[mmap.mmap] = []
        self._lent = 0  # bytes of the buffers taken and not given back

    def take(self, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` bytes, from the smallest kept buffer that fits it at
        :data:`REUSE_FILL` or better, else new memory."""
        fits = [b for b in self._free if nbytes <= len(b) and nbytes >= self.REUSE_FILL * len(b)]
        if fits:
            buf = min(fits, key=len)
            self._free.remove(buf)
            self._lent += len(buf)
            return memoryview(buf)[:nbytes]
        view = _new_buffer(nbytes)
        self._lent += len(view.obj)  # type: ignore[arg-type]  # an mmap
        return view

    def give(self, view: memoryview) -> None:
        buf = view.obj
        if not isinstance(buf, mmap.mmap):
            return
        self._lent -= len(buf)
        if self._lent + sum(map(len, self._free)) + len(buf) <= self.limit:
            self._free.append(buf)


def fetch_ranges(
    volume: Volume,
    requests: Sequence[RangeRequest[T]],
    consume: Callable[[RangeRequest[T], memoryview], None],
    *,
    records: Mapping[str, FileRecord],
    chunk_bytes: int,
    max_inflight_bytes: int,
    workers: int,
    thread_name: str = "uc-range",
    in_place: Callable[[RangeRequest[T]], Sequence[tuple[int, int, memoryview]]] | None = None,
) -> FetchStats:
    """Fetch each request's bytes in parallel pieces (the pieces of up to ``workers`` requests
    queued in turn, one of each, so that the workers read as many different files at once as they
    can), with at most ``max_inflight_bytes`` fetched ahead of the consumer (a
    :class:`~uc_checkpoint.engine.ranges.ByteBudget`; one larger request is fetched alone), and
    call ``consume(request, data)`` on this thread for each as soon as it is complete and
    verified. ``data`` is valid only during the call.

    Args:
        records: the record per file whose block CRC-32s verify its ranges (pass none to skip the
            check).
        in_place: the spans of a request received straight into other memory (see
            :class:`RangeFetch`); ``consume`` finds the buffer's bytes there as they were. Only the
            buffered bytes count against ``max_inflight_bytes``.

    Raises:
        CorruptCheckpointError: a file is missing or short, or a block fails its checksum.
        TransferError: a read failed for another reason.
        Whatever ``consume`` raises. On any error the other reads are cancelled or waited for.
    """
    started, retries = time.perf_counter(), volume.retries
    ready: queue.SimpleQueue[RangeFetch[T]] = queue.SimpleQueue()
    budget = ByteBudget(max_inflight_bytes)
    buffers = _Buffers(max_inflight_bytes)
    pool = TransferPool(workers, name=thread_name)
    # Ranges begun whose pieces are not all queued: their pieces are queued in turn, one of each,
    # so the workers read as many different files at once as they can. Queued range by range, the
    # workers all read one file: a store that serves one object's reads one at a time (moto holds
    # a lock per object around reading all of it) then served one worker at a time.
    feeding: collections.deque[RangeFetch[T]] = collections.deque()
    outstanding = nbytes = 0

    def finish(done: RangeFetch[T]) -> None:
        nonlocal outstanding, nbytes
        outstanding -= 1
        data = done.result()
        consume(done.request, data)
        buffers.give(data)  # ``data`` is valid only during consume: its memory can be received into again
        nbytes += done.request.nbytes
        budget.give(done.buffered_bytes)

    def consume_ready() -> None:
        while True:
            try:
                done = ready.get_nowait()
            except queue.Empty:
                return
            finish(done)

    def feed_one() -> None:
        # Finished ranges are consumed before a submit that may wait for a free worker: waiting
        # in the pool's submit left every finished range unconsumed (and its memory not reused)
        # until the last request was queued.
        consume_ready()
        fetch = feeding.popleft()
        fetch.submit_next()
        if fetch.unsubmitted:
            feeding.append(fetch)

    def consume_one() -> None:
        while feeding:  # a range is ready only once all its pieces have been queued
            feed_one()
        if outstanding:
            finish(ready.get())

    try:
        for request in requests:
            fetch = RangeFetch(
                pool,
                ready,
                volume,
                request,
                chunk_bytes=chunk_bytes,
                record=records.get(request.name),
                in_place=in_place(request) if in_place is not None else (),
            )
            while not budget.try_take(fetch.buffered_bytes):
                consume_one()
            fetch.begin(buffers.take(request.nbytes))
            outstanding += 1
            feeding.append(fetch)
            while len(feeding) >= workers:
                feed_one()
        while outstanding:
            consume_one()
    finally:
        pool.shutdown(cancel_pending=True)
        volume.close()  # its transfer threads end here; the next use makes new ones
    nfiles = len({r.name for r in requests})
    return FetchStats(nfiles, nbytes, time.perf_counter() - started, volume.retries - retries)
