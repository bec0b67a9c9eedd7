"""Reads of one file through an fsspec volume never share a file handle (issue 34, item 3).

fsspec's memory filesystem hands every ``open()`` of a file the same object (its ``MemoryFile``,
rewound on each open), so two reads that each opened the file move each other's position: two loads
of one checkpoint at once then fail their checksums (a valid checkpoint that does not load). The
volume reads through the filesystem's own range primitive (``cat_file`` with ``start``/``end``)
instead, each call independent of the others. These tests load one ``memory://`` checkpoint two and
four times at once, whole-file (``prefetch_files=True``) and ranged (the default on fsspec volumes),
through a reader each (and through one reader, which serves one load at a time: the others are
refused, never mixed), and check the volume's reads directly.
"""

from __future__ import annotations

import sys
import threading
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from tests.conftest import assert_state_dict_equal, empty_like_state_dict, make_state_dict
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import ReaderOptions
from uc_checkpoint.errors import CorruptCheckpointError
from uc_checkpoint.format.integrity import CHUNK_SIZE
from uc_checkpoint.volumes import FsspecVolume, fsspec_volume

warnings.filterwarnings("ignore", category=UserWarning)

#: Rows per tensor of the saved state dict: 4096 rows of 64 float32 are 1 MiB, so its data file is
#: about 10 MiB, ten of the copy loop's 1 MiB pieces: loads at once interleave between them.
ROWS = 4096

#: Loads or downloads each thread makes one after the other (the race is between threads' steps:
#: more of them, more chances to interleave).
ROUNDS = 3


def _payload(size: int, seed: int = 0) -> bytes:
    """``size`` bytes in which every 4 MiB block differs from the others (a read at the wrong
    offset gives other bytes)."""
    block = bytes((i * 31 + seed) % 251 for i in range(65536))
    out = bytearray()
    n = 0
    while len(out) < size:
        out += bytes([n % 256]) + block[1:]
        n += 1
    return bytes(out[:size])


@pytest.fixture
def url(memory_root: str) -> str:
    return f"memory://{memory_root}/ckpt"


@pytest.fixture
def saved(url: str, staging: Path) -> dict[str, Any]:
    """A checkpoint saved at ``url``; the state dict it holds."""
    sd = make_state_dict(seed=3, rows=ROWS)
    dcp.save(sd, storage_writer=UCVolumeWriter(url))
    return sd


def _at_once(count: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(0)`` ... ``fn(count - 1)`` in ``count`` threads started together, switching between
    threads far more often than by default (so that reads interleave between any two of their
    steps, as they do with I/O that releases the GIL); their results (the first error raised, if
    any)."""
    barrier = threading.Barrier(count)

    def run(i: int) -> Any:
        barrier.wait(30)
        return fn(i)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(count) as pool:
            return list(pool.map(run, range(count)))
    finally:
        sys.setswitchinterval(interval)


# ---- the volume's reads -------------------------------------------------------------------------
def test_two_open_handles_of_one_file_keep_their_own_positions(url: str) -> None:
    volume = FsspecVolume(url)
    data = _payload(3 * 65536)
    volume.publish_bytes("f.distcp", data)
    with volume.open_read("f.distcp") as (first, size1), volume.open_read("f.distcp") as (second, size2):
        assert (size1, size2) == (len(data), len(data))
        assert first.read(100) == data[:100]
        assert second.read(100) == data[:100]  # not bytes 100-199: the handles are not one object
        first.seek(65536)
        assert second.read(50) == data[100:150]
        assert first.read(10) == data[65536:65546]


@pytest.mark.parametrize("threads", [2, 4])
def test_whole_file_downloads_of_one_file_at_once(url: str, tmp_path: Path, threads: int) -> None:
    volume = FsspecVolume(url)
    data = _payload(5 * CHUNK_SIZE + 12345)
    volume.publish_bytes("f.distcp", data)

    def download(i: int) -> list[tuple[int, str]]:
        out = []
        for round_ in range(ROUNDS):
            record = volume.download_file("f.distcp", tmp_path / f"copy-{i}-{round_}", expected_size=len(data))
            out.append((record.size, record.crc32))
        return out

    results = _at_once(threads, download)
    assert results == [[(len(data), f"{zlib.crc32(data):08x}")] * ROUNDS] * threads
    for copy in tmp_path.glob("copy-*"):
        assert copy.read_bytes() == data


@pytest.mark.parametrize("threads", [2, 4])
def test_ranged_reads_of_one_file_at_once(url: str, threads: int) -> None:
    volume = FsspecVolume(url)
    data = _payload(2 * CHUNK_SIZE)
    volume.publish_bytes("f.distcp", data)
    spans = [(start, start + 70001) for start in range(0, len(data) - 70001, 50021)]

    def read(i: int) -> bool:
        ok = True
        for start, end in spans[i::threads] + spans:
            ok &= volume.read_range("f.distcp", start, end) == data[start:end]
            out = bytearray(end - start)
            volume.read_range_into("f.distcp", start, [memoryview(out)[:7], memoryview(out)[7:]])
            ok &= bytes(out) == data[start:end]
        return ok

    assert _at_once(threads, read) == [True] * threads


def _count_pieces(volume: FsspecVolume, monkeypatch: pytest.MonkeyPatch, shrink_to: int | None = None) -> list[tuple]:
    """Record each ``cat_file`` range of ``volume`` (and, with ``shrink_to``, cut the file to that
    many bytes after the first piece); the list of ``(start, end)`` it fills."""
    real_cat_file = volume.fs.cat_file
    calls: list[tuple] = []

    def recording(path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        calls.append((start, end))
        if shrink_to is not None and len(calls) == 2:
            volume.fs.pipe_file(path, real_cat_file(path, start=0, end=shrink_to))
        return bytes(real_cat_file(path, start=start, end=end, **kwargs))

    monkeypatch.setattr(volume.fs, "cat_file", recording)  # the shared instance: undone after the test
    monkeypatch.setattr(fsspec_volume, "DOWNLOAD_PIECE_BYTES", CHUNK_SIZE)
    return calls


def test_a_download_is_read_in_bounded_pieces_up_to_the_size_checked(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    volume = FsspecVolume(url)
    data = _payload(3 * CHUNK_SIZE + 10)
    volume.publish_bytes("f.distcp", data)
    calls = _count_pieces(volume, monkeypatch)
    record = volume.download_file("f.distcp", tmp_path / "all", expected_size=len(data))
    assert (record.size, (tmp_path / "all").read_bytes() == data) == (len(data), True)
    edges = [0, CHUNK_SIZE, 2 * CHUNK_SIZE, 3 * CHUNK_SIZE, len(data)]
    assert calls == list(zip(edges, edges[1:]))
    calls.clear()
    # min_size (a checkpoint without a manifest): only that many bytes, though the file is longer.
    record = volume.download_file("f.distcp", tmp_path / "part", min_size=CHUNK_SIZE + 1000)
    assert (tmp_path / "part").read_bytes() == data[: CHUNK_SIZE + 1000]
    assert calls == [(0, CHUNK_SIZE), (CHUNK_SIZE, CHUNK_SIZE + 1000)]


def test_a_file_that_shrinks_while_downloaded_is_named(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    volume = FsspecVolume(url)
    data = _payload(3 * CHUNK_SIZE)
    volume.publish_bytes("f.distcp", data)
    _count_pieces(volume, monkeypatch, shrink_to=CHUNK_SIZE + 5)
    with pytest.raises(
        CorruptCheckpointError, match=rf"f\.distcp changed while it was read: {CHUNK_SIZE + 5} bytes read"
    ):
        volume.download_file("f.distcp", tmp_path / "f", expected_size=len(data))


def test_an_open_stream_reads_through_ranges_and_ends_at_the_size(url: str) -> None:
    volume = FsspecVolume(url)
    volume.publish_bytes("f.distcp", b"0123456789")
    with volume.open_read("f.distcp") as (src, size):
        volume.fs.pipe_file(f"{volume.root}/f.distcp", b"0123456789-grown")
        assert (size, src.read(3), src.read(), src.read(), src.tell()) == (10, b"012", b"3456789", b"", 10)
        src.seek(-4, 2)
        assert src.read(100) == b"6789"


def test_missing_and_wrongly_sized_files_are_named(url: str, tmp_path: Path) -> None:
    volume = FsspecVolume(url)
    volume.publish_bytes("f.distcp", b"x" * 100)
    where = volume.url_of("gone.distcp")
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint file {where} is missing"):
        volume.download_file("gone.distcp", tmp_path / "gone")
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint file {where} is missing"):
        volume.read_range("gone.distcp", 0, 10)
    with pytest.raises(CorruptCheckpointError, match=r"f\.distcp has 100 bytes, the checkpoint recorded 101"):
        volume.download_file("f.distcp", tmp_path / "f", expected_size=101)
    with pytest.raises(CorruptCheckpointError, match=r"f\.distcp is truncated: bytes 90-109 needed, got 10"):
        volume.read_range("f.distcp", 90, 110)
    with pytest.raises(CorruptCheckpointError, match=r"f\.distcp is truncated: bytes 200-209 needed, got 0"):
        volume.read_range("f.distcp", 200, 210)
    with pytest.raises(ValueError, match=r"invalid byte range -10-100 of .*f\.distcp"):
        volume.read_range("f.distcp", -10, 100)  # cat_file would read the last 10 bytes
    with pytest.raises(ValueError, match="invalid byte range 50-40"):
        volume.read_range("f.distcp", 50, 40)


# ---- loads ------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch_files", [True, False], ids=["whole-file", "ranged"])
@pytest.mark.parametrize("shared_reader", [True, False], ids=["one-reader", "reader-each"])
@pytest.mark.parametrize("loads", [2, 4])
def test_loads_of_one_checkpoint_at_once(
    url: str, saved: dict[str, Any], loads: int, shared_reader: bool, prefetch_files: bool
) -> None:
    shared = UCVolumeReader(url, options=ReaderOptions(prefetch_files=prefetch_files))

    def load(i: int) -> list[dict[str, Any]]:
        reader = shared if shared_reader else UCVolumeReader(url, options=ReaderOptions(prefetch_files=prefetch_files))
        outs = []
        for _ in range(ROUNDS):
            out = empty_like_state_dict(saved)
            try:
                dcp.load(out, storage_reader=reader)
            except BaseException as exc:  # one reader serves one load at a time: refused, never mixed
                if not shared_reader or "use a new UCVolumeReader for each load" not in str(exc):
                    raise
                continue
            outs.append(out)
        return outs

    results = _at_once(loads, load)
    assert sum(len(outs) for outs in results) >= (1 if shared_reader else loads * ROUNDS)
    for outs in results:
        for out in outs:
            assert_state_dict_equal(out, saved)
