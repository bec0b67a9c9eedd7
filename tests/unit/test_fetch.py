"""The load's fetch pipelines (``uc_checkpoint.engine.fetch``) on a local and an in-memory fsspec
volume, without DCP: bytes arrive verified, a damaged block or file is named, a failing read ends
the fetch as one ``TransferError`` with the rest cancelled, and the byte budget bounds what is held."""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from uc_checkpoint.engine.fetch import fetch_files, fetch_ranges
from uc_checkpoint.engine.ranges import RangeRequest, plan_ranges
from uc_checkpoint.errors import CorruptCheckpointError, TransferError
from uc_checkpoint.format.integrity import Digest, FileRecord
from uc_checkpoint.volumes import FsspecVolume, LocalVolume, Volume

BLOCK = 64 << 10  # checksum block size of these tests' records (the real one is 4 MiB)


class Recording:
    """A volume wrapper that records each read and can slow reads down or fail one.

    Attributes:
        reads: ``(name, start, end)`` of every ``read_range`` that reached the volume.
        held_peak: the most bytes returned by reads and not yet marked consumed (:meth:`consumed`).
        concurrent_peak: the most reads running at once.
    """

    def __init__(self, inner: Volume, *, delay_s: float = 0.0, fail: tuple[str, int] | None = None) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.fail = fail  # (name, start) of the read that raises a foreign error
        self.reads: list[tuple[str, int, int]] = []
        self.downloads: list[str] = []
        self.closed = 0
        self._lock = threading.Lock()
        self._other_started = threading.Event()
        self._running = 0
        self._held = 0
        self.held_peak = 0
        self.concurrent_peak = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def read_range_into(self, name: str, start: int, out: memoryview, *, file_size: int | None = None) -> None:
        out[:] = self.read_range(name, start, start + len(out))  # recorded as a read_range

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with self._lock:
            self.reads.append((name, start, end))
            self._running += 1
            self.concurrent_peak = max(self.concurrent_peak, self._running)
        try:
            if self.fail == (name, start):
                # Fail while another read is running, so that the pieces queued behind it are what
                # the free worker finds next.
                self._other_started.wait(5)
                raise OSError("injected read failure")
            self._other_started.set()
            time.sleep(self.delay_s)
            data = self.inner.read_range(name, start, end)
        finally:
            with self._lock:
                self._running -= 1
        with self._lock:
            self._held += len(data)
            self.held_peak = max(self.held_peak, self._held)
        return data

    def download_file(self, name: str, local_path: Path, **kwargs: Any) -> FileRecord:
        with self._lock:
            self.downloads.append(name)
        if self.fail == (name, 0):
            raise OSError("injected download failure")
        time.sleep(self.delay_s)
        return self.inner.download_file(name, local_path, **kwargs)

    def consumed(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes

    def close(self) -> None:
        self.closed += 1
        self.inner.close()


@pytest.fixture(params=["local", "memory"])
def volume(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Volume]:
    if request.param == "local":
        yield LocalVolume(tmp_path / "ckpt")
    else:
        vol = FsspecVolume(f"memory://uc-fetch-{tmp_path.name}")
        yield vol
        for name in vol.list_files():  # the memory filesystem lives as long as the process
            vol.delete(name)


def _put(volume: Volume, name: str, data: bytes) -> FileRecord:
    """Write ``data`` as ``name`` and return its record with :data:`BLOCK`-byte block checksums."""
    volume.prepare_for_write()
    volume.publish_bytes(name, data)
    digest = Digest(block_size=BLOCK)
    digest.update(data)
    return digest.record(name)


def _content(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def test_ranges_arrive_verified_in_pieces(volume: Volume) -> None:
    data = {f"f{i}.distcp": _content(5 * BLOCK + 123, i) for i in range(3)}
    records = {name: _put(volume, name, content) for name, content in data.items()}
    # Items scattered over the files; ranges widen to whole blocks, big ones are read in pieces.
    spans = [(name, off, 1000, (name, off)) for name in data for off in (10, 2 * BLOCK + 5, 4 * BLOCK + 100)]
    requests = plan_ranges(
        spans, file_sizes={n: len(d) for n, d in data.items()}, block_sizes={n: BLOCK for n in data}, gap_bytes=0
    )
    rec = Recording(volume)
    got: dict[tuple[str, int], bytes] = {}

    def consume(req: RangeRequest[tuple[str, int]], view: memoryview) -> None:
        assert req.start % BLOCK == 0 and (req.end % BLOCK == 0 or req.end == len(data[req.name]))
        assert bytes(view) == data[req.name][req.start : req.end]
        for name, off in req.items:
            got[(name, off)] = bytes(view[off - req.start : off - req.start + 1000])

    stats = fetch_ranges(
        rec,  # type: ignore[arg-type]  # a duck-typed volume
        requests,
        consume,
        records=records,
        chunk_bytes=BLOCK // 2,
        max_inflight_bytes=1 << 30,
        workers=3,
    )
    assert got == {(n, off): data[n][off : off + 1000] for n, off, _l, _i in spans}
    assert stats.files == 3 and stats.bytes == sum(r.nbytes for r in requests)
    assert rec.reads and all(end - start <= BLOCK // 2 for _n, start, end in rec.reads)
    assert len(rec.reads) > len(requests)  # pieces, not one read per request
    assert rec.closed == 1


def test_finished_ranges_are_consumed_while_later_ones_wait_for_a_worker(volume: Volume) -> None:
    data = {f"f{i}.distcp": _content(BLOCK, i) for i in range(12)}
    records = {name: _put(volume, name, content) for name, content in data.items()}
    rec = Recording(volume, delay_s=0.01)
    reads_at_consume: list[int] = []

    def consume(req: RangeRequest[str], view: memoryview) -> None:
        assert bytes(view) == data[req.name]
        reads_at_consume.append(len(rec.reads))

    workers = 2
    fetch_ranges(
        rec,  # type: ignore[arg-type]  # a duck-typed volume
        [RangeRequest(name, 0, BLOCK, [name]) for name in data],
        consume,
        records=records,
        chunk_bytes=BLOCK,
        max_inflight_bytes=1 << 30,  # the byte budget never holds a request back here
        workers=workers,
    )
    assert len(reads_at_consume) == 12
    # The first range is consumed before more requests were queued than the pool runs and queues
    # (2 x workers); waiting for a free worker instead held every finished range until the last
    # request was queued.
    assert reads_at_consume[0] <= 2 * workers, reads_at_consume


def test_the_workers_read_different_files_at_once(volume: Volume) -> None:
    # Each file one range of 4 pieces: queued range by range, both workers read one file at a time,
    # which a store serving one object's reads one after another (moto) ran one worker at a time.
    data = {f"f{i}.distcp": _content(4 * BLOCK, i) for i in range(4)}
    records = {name: _put(volume, name, content) for name, content in data.items()}
    rec = Recording(volume, delay_s=0.01)
    got: dict[str, bytes] = {}

    def consume(req: RangeRequest[str], view: memoryview) -> None:
        got[req.name] = bytes(view)

    workers = 2
    fetch_ranges(
        rec,  # type: ignore[arg-type]  # a duck-typed volume
        [RangeRequest(name, 0, 4 * BLOCK, [name]) for name in data],
        consume,
        records=records,
        chunk_bytes=BLOCK,
        max_inflight_bytes=1 << 30,
        workers=workers,
    )
    assert got == data
    assert len(rec.reads) == 16
    # Every window of reads the workers started together spans as many files as there are workers.
    for i in range(0, 16, workers):
        assert len({name for name, _s, _e in rec.reads[i : i + workers]}) == workers, rec.reads


@pytest.mark.parametrize("chunk", [BLOCK // 2, BLOCK, 3 * BLOCK // 2, 2 * BLOCK, 8 * BLOCK])
@pytest.mark.parametrize("block", [0, 2, 5])
def test_a_damaged_block_is_caught_whatever_the_pieces(volume: Volume, chunk: int, block: int) -> None:
    # Blocks a piece holds whole are checked by its worker, blocks cut by a piece boundary (pieces
    # smaller than a block, or off the block grid) after the range is complete; the file's last
    # block (5) is short.
    _fetch_a_damaged_file(volume, _content(5 * BLOCK + 123, 3), block * BLOCK + 100, chunk)


def _fetch_a_damaged_file(
    volume: Volume, good: bytes, where: int, chunk: int, in_place: list[tuple[int, int]] | None = None
) -> None:
    """Store ``good`` with the byte at ``where`` flipped and fetch it as one range in pieces of
    ``chunk`` (spans ``in_place`` received into memory of their own): the block holding ``where``
    must be named, and nothing consumed."""
    record = _put(volume, "data.distcp", good)
    bad = bytearray(good)
    bad[where] ^= 0x10
    volume.publish_bytes("data.distcp", bytes(bad))
    consumed: list[str] = []
    with pytest.raises(CorruptCheckpointError, match=rf"\(block {where // BLOCK}\)"):
        fetch_ranges(
            volume,
            [RangeRequest("data.distcp", 0, len(good), ["item"])],
            lambda req, view: consumed.append(req.name),
            records={"data.distcp": record},
            chunk_bytes=chunk,
            max_inflight_bytes=1 << 30,
            workers=2,
            in_place=lambda req: [(lo, hi, memoryview(bytearray(hi - lo))) for lo, hi in in_place or []],
        )
    assert consumed == []


def test_a_damaged_block_is_named(volume: Volume) -> None:
    good = _content(4 * BLOCK, 1)
    record = _put(volume, "data.distcp", good)
    bad = bytearray(good)
    bad[2 * BLOCK + 17] ^= 0xFF
    volume.publish_bytes("data.distcp", bytes(bad))
    requests = [RangeRequest("data.distcp", 0, 4 * BLOCK, ["item"])]
    consumed: list[str] = []
    with pytest.raises(CorruptCheckpointError) as ei:
        fetch_ranges(
            volume,
            requests,
            lambda req, view: consumed.append(req.name),
            records={"data.distcp": record},
            chunk_bytes=BLOCK,
            max_inflight_bytes=1 << 30,
            workers=2,
        )
    assert volume.url_of("data.distcp") in str(ei.value)
    assert f"bytes {2 * BLOCK}-{3 * BLOCK - 1} (block 2)" in str(ei.value)
    assert consumed == []  # nothing unverified reached the consumer
    # Without a record the same bytes pass (the check above is what caught them).
    fetch_ranges(
        volume,
        requests,
        lambda req, view: consumed.append(req.name),
        records={},
        chunk_bytes=BLOCK,
        max_inflight_bytes=1 << 30,
        workers=2,
    )
    assert consumed == ["data.distcp"]


def test_a_failing_read_is_one_transfer_error_and_the_rest_is_cancelled(volume: Volume) -> None:
    content = _content(16 * BLOCK, 2)
    _put(volume, "big.distcp", content)
    _put(volume, "later.distcp", content)
    requests = [
        RangeRequest("big.distcp", 0, 16 * BLOCK, ["a"]),
        RangeRequest("later.distcp", 0, 16 * BLOCK, ["b"]),
    ]
    rec = Recording(volume, delay_s=0.2, fail=("big.distcp", 0))
    consumed: list[str] = []
    with pytest.raises(TransferError) as ei:
        fetch_ranges(
            rec,  # type: ignore[arg-type]
            requests,
            lambda req, view: consumed.append(req.name),
            records={},
            chunk_bytes=BLOCK,  # 16 pieces per request
            max_inflight_bytes=16 * BLOCK,  # the second request waits for the first
            workers=2,
        )
    err = ei.value
    assert str(err) == f"reading {volume.url_of('big.distcp')} failed: injected read failure"
    assert isinstance(err.__cause__, OSError) and not isinstance(err.__cause__, TransferError)
    # The failed piece and the one running beside it reached the volume; the pieces queued behind
    # them were skipped or cancelled, and the next request never started.
    assert len(rec.reads) == 2, rec.reads
    assert all(name == "big.distcp" for name, _s, _e in rec.reads)
    assert consumed == [] and rec.closed == 1


def test_the_byte_budget_bounds_bytes_held(volume: Volume) -> None:
    size = 2 * BLOCK
    names = [f"f{i:02d}.distcp" for i in range(12)]
    for i, name in enumerate(names):
        _put(volume, name, _content(size, i))
    requests = [RangeRequest(name, 0, size, [name]) for name in names]

    def run(budget: int) -> Recording:
        rec = Recording(volume, delay_s=0.005)

        def consume(req: RangeRequest[str], view: memoryview) -> None:
            time.sleep(0.03)  # a slow consumer: reads would run ahead of it without the budget
            rec.consumed(req.nbytes)

        fetch_ranges(
            rec,  # type: ignore[arg-type]
            requests,
            consume,
            records={},
            chunk_bytes=size,
            max_inflight_bytes=budget,
            workers=4,
        )
        return rec

    bounded = run(3 * size)
    assert bounded.held_peak <= 3 * size, bounded.held_peak
    assert bounded.held_peak >= 2 * size  # reads did run ahead of the consumer, within the budget
    assert bounded.concurrent_peak <= 4
    unbounded = run(1 << 30)
    assert unbounded.held_peak > 3 * size  # the bound above is the budget's doing


def test_a_range_larger_than_the_budget_is_fetched_alone(volume: Volume) -> None:
    _put(volume, "huge.distcp", _content(8 * BLOCK, 3))
    _put(volume, "small.distcp", _content(BLOCK, 4))
    requests = [RangeRequest("huge.distcp", 0, 8 * BLOCK, [1]), RangeRequest("small.distcp", 0, BLOCK, [2])]
    rec = Recording(volume)
    order: list[str] = []

    def consume(req: RangeRequest[int], view: memoryview) -> None:
        order.append(req.name)
        rec.consumed(req.nbytes)

    fetch_ranges(
        rec,  # type: ignore[arg-type]
        requests,
        consume,
        records={},
        chunk_bytes=BLOCK,
        max_inflight_bytes=BLOCK,
        workers=4,
    )
    assert order == ["huge.distcp", "small.distcp"]
    assert rec.held_peak == 8 * BLOCK


def test_whole_files_arrive_verified_and_staging_is_removed(volume: Volume, tmp_path: Path) -> None:
    data = {f"f{i}.distcp": _content(BLOCK + i, i) for i in range(5)}
    records = {name: _put(volume, name, content) for name, content in data.items()}
    staging = tmp_path / "staging" / "load" / "rank-0"
    rec = Recording(volume)
    seen: dict[str, bytes] = {}

    def consume(name: str, path: Path) -> None:
        assert path.parent == staging
        seen[name] = path.read_bytes()

    stats = fetch_files(
        rec,  # type: ignore[arg-type]
        list(data),
        staging,
        consume,
        records=records,
        min_sizes={},
        verify=True,
        workers=2,
    )
    assert seen == data
    assert stats.files == 5 and stats.bytes == sum(len(d) for d in data.values())
    assert not staging.exists() and rec.closed == 1


def test_a_whole_file_failing_its_checksum_is_named(volume: Volume, tmp_path: Path) -> None:
    record = _put(volume, "data.distcp", _content(BLOCK, 5))
    volume.publish_bytes("data.distcp", _content(BLOCK, 6))  # same size, other bytes
    staging = tmp_path / "staging"
    consumed: list[str] = []
    with pytest.raises(CorruptCheckpointError, match="fails its checksum") as ei:
        fetch_files(
            volume,
            ["data.distcp"],
            staging,
            lambda name, path: consumed.append(name),
            records={"data.distcp": record},
            min_sizes={},
            verify=True,
            workers=1,
        )
    assert volume.url_of("data.distcp") in str(ei.value)
    assert consumed == [] and not staging.exists()


def test_a_failing_download_is_one_transfer_error(volume: Volume, tmp_path: Path) -> None:
    names = [f"f{i}.distcp" for i in range(4)]
    for i, name in enumerate(names):
        _put(volume, name, _content(BLOCK, i))
    rec = Recording(volume, fail=("f0.distcp", 0))
    staging = tmp_path / "staging"
    with pytest.raises(TransferError) as ei:
        fetch_files(
            rec,  # type: ignore[arg-type]
            names,
            staging,
            lambda name, path: None,
            records={},
            min_sizes={},
            verify=True,
            workers=1,
        )
    assert str(ei.value) == f"reading {volume.url_of('f0.distcp')} failed: injected download failure"
    assert isinstance(ei.value.__cause__, OSError)
    assert rec.closed == 1 and not staging.exists()


def test_range_buffers_are_received_into_again_within_their_limit() -> None:
    """Buffers lent out plus buffers kept stay within the limit, and a kept buffer serves only a
    range that fills 80% of it: what a load holds stays near its max_inflight_bytes."""
    from uc_checkpoint.engine.fetch import _Buffers

    pool = _Buffers(limit=300)

    def held() -> int:
        return pool._lent + sum(map(len, pool._free))

    a = pool.take(100)
    # New memory is an anonymous map: untouched until received into (no zero-fill by this thread).
    assert len(a) == 100 and isinstance(a.obj, mmap.mmap) and not a.readonly and bytes(a) == bytes(100)
    pool.give(a)
    b = pool.take(80)  # fills 80% of the kept 100-byte buffer: received into it
    assert b.obj is a.obj and len(b) == 80
    c = pool.take(40)  # nothing kept that fits: new memory
    assert c.obj is not a.obj
    pool.give(b)
    pool.give(c)  # kept: 100 + 40 bytes
    x = pool.take(79)  # under 80% of 100 and more than 40: new memory
    assert x.obj is not a.obj and x.obj is not c.obj
    y = pool.take(35)
    assert y.obj is c.obj
    big = pool.take(250)  # alone over the limit (the byte budget lets one larger range through)
    pool.give(big)  # not kept: 119 lent + 100 kept + 250 > 300
    assert held() == 219
    pool.give(x)
    pool.give(y)
    assert held() <= pool.limit
    assert pool.take(90).obj is a.obj


def _in_place_spans(size: int) -> list[tuple[int, int]]:
    """Spans of a ``size``-byte range received elsewhere: inside a block, across block and piece
    boundaries, one touching the range's end."""
    return [(100, 900), (BLOCK - 10, 2 * BLOCK + 10), (3 * BLOCK + 1, 4 * BLOCK + 5), (size - 7, size)]


@pytest.mark.parametrize("chunk", [BLOCK // 2, BLOCK, 3 * BLOCK // 2, 8 * BLOCK])
def test_spans_received_in_place_arrive_there_verified(volume: Volume, chunk: int) -> None:
    """Bytes of spans given to ``in_place`` land in their own memory (a tensor's, in a load),
    never in the range's buffer, whatever the pieces; every byte is verified all the same."""
    data = _content(5 * BLOCK + 123, 4)
    record = _put(volume, "data.distcp", data)
    spans = _in_place_spans(len(data))
    into = {span: memoryview(bytearray(span[1] - span[0])) for span in spans}
    seen: list[bytes] = []

    def consume(req: RangeRequest[str], view: memoryview) -> None:
        buffered = bytearray(view)
        for lo, hi in spans:
            assert not any(buffered[lo:hi]), f"bytes {lo}-{hi} reached the buffer"
            buffered[lo:hi] = into[(lo, hi)]
        seen.append(bytes(buffered))

    fetch_ranges(
        volume,
        [RangeRequest("data.distcp", 0, len(data), ["item"])],
        consume,
        records={"data.distcp": record},
        chunk_bytes=chunk,
        max_inflight_bytes=1 << 30,
        workers=3,
        in_place=lambda req: [(lo, hi, into[(lo, hi)]) for lo, hi in spans],
    )
    assert seen == [data]


@pytest.mark.parametrize("where", [150, BLOCK + 3, 4 * BLOCK + 2])
def test_a_damaged_byte_received_in_place_is_caught(volume: Volume, where: int) -> None:
    good = _content(5 * BLOCK + 123, 5)
    _fetch_a_damaged_file(volume, good, where, BLOCK, _in_place_spans(len(good)))
