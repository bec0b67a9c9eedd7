"""Damaged shards, written by each format's own library and then cut or altered: every reader refuses
what its format's library refuses (and what the format's own structure shows) with a
``DataFormatError`` naming the file, and never returns fewer samples or fields without one. A
damaged cached index is rebuilt, never used."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import random
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.reader_data import FORMATS, plain
from uc_checkpoint.data.readers import GzipJsonlReader, HfDatasetReader, ParquetReader, TokenReader, WebDatasetReader
from uc_checkpoint.data.readers.base import INDEX_SUFFIX, ShardReader
from uc_checkpoint.errors import DataFormatError


def read_all(reader: ShardReader) -> list[list[Any]]:
    """Every sample of every shard (counted, then read)."""
    return [[plain(s) for s in reader(shard, 0, shard.num_samples)] for shard in reader.shards()]


def outcome(make: Callable[[Path], ShardReader], root: Path, name: str) -> list[list[Any]] | None:
    """All samples the reader gives for ``root``, or None when it refuses with an error naming ``name``."""
    try:
        return read_all(make(root))
    except DataFormatError as exc:
        assert name in str(exc), exc
        return None


def place(tmp_path: Path, name: str, data: bytes) -> Path:
    """A fresh directory holding only ``name`` with ``data`` (no index left from another try)."""
    root = tmp_path / "cut"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    (root / name).write_bytes(data)
    return root


# ---- Arrow IPC streams (HfDatasetReader) ------------------------------------------------------------
def arrow_stream(rows: int = 30, batch: int = 10) -> bytes:
    """An Arrow IPC stream written by pyarrow: a schema, ``rows / batch`` record batches, end-of-stream."""
    table = pa.table({"i": list(range(rows)), "t": [f"row {k}" for k in range(rows)]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for b in table.to_batches(max_chunksize=batch):
            writer.write_batch(b)
    return bytes(sink.getvalue())


def message_starts(data: bytes) -> list[int]:
    """Where each message of an Arrow stream starts, as pyarrow reads them (the end-of-stream marker last)."""
    stream = pa.BufferReader(pa.py_buffer(data))
    starts = [0]
    while True:
        try:
            pa.ipc.read_message(stream)
        except EOFError:
            return starts
        starts.append(stream.tell())


def test_arrow_stream_cut_anywhere_is_refused_where_pyarrow_refuses(tmp_path: Path) -> None:
    """Cut at every byte near each message boundary and at 100 random ones: where pyarrow's stream
    reader raises, so does the reader; where pyarrow reads (a cut between messages, which an IPC
    stream allows), both count the same rows."""
    data = arrow_stream()
    starts = message_starts(data)
    name = "data-00000-of-00001.arrow"
    rng = random.Random(3)
    cuts = {rng.randrange(len(data)) for _ in range(100)} | {len(data)}
    cuts |= {b + k for b in starts for k in range(-8, 9) if 0 <= b + k <= len(data)}
    refused = 0
    for cut in sorted(cuts):
        try:
            rows: int | None = pa.ipc.open_stream(pa.py_buffer(data[:cut])).read_all().num_rows
        except (pa.ArrowInvalid, OSError):
            rows = None
        got = outcome(HfDatasetReader, place(tmp_path, name, data[:cut]), name)
        assert (None if got is None else len(got[0])) == rows, f"cut at byte {cut}"
        refused += got is None
    assert refused == len(cuts - set(starts[1:]) - {len(data)})  # accepted only between messages


def test_datasets_file_cut_into_a_message_is_refused_like_load_from_disk(tmp_path: Path) -> None:
    """The field case: a save_to_disk file cut 1-7 bytes into a message (here into the last record
    batch's prefix and into the end-of-stream marker): ``datasets.load_from_disk`` raises, so does
    the reader, naming the file."""
    import datasets  # a test dependency; imported here, as it is slow to import

    datasets.Dataset.from_dict({"i": list(range(30))}).save_to_disk(str(tmp_path / "d"), num_shards=1)
    (arrow,) = (tmp_path / "d").glob("*.arrow")
    data = arrow.read_bytes()
    boundaries = message_starts(data)[-2:]  # the last record batch and the end-of-stream marker
    for cut in [b + k for b in boundaries for k in range(1, 8)]:
        arrow.write_bytes(data[:cut])
        with pytest.raises((pa.ArrowInvalid, OSError)):
            datasets.load_from_disk(str(tmp_path / "d")).to_list()
        with pytest.raises(DataFormatError, match=rf"{arrow.name}: truncated"):
            HfDatasetReader(tmp_path / "d").shards()
        for index in (tmp_path / "d").glob("*" + INDEX_SUFFIX):
            index.unlink()


def test_arrow_stream_without_end_marker_reads_whole(tmp_path: Path) -> None:
    """An IPC stream may end by closing instead of a marker: pyarrow reads it, and so does the reader."""
    data = arrow_stream()[:-8]
    got = outcome(HfDatasetReader, place(tmp_path, "a.arrow", data), "a.arrow")
    assert got is not None and [r["i"] for r in got[0]] == list(range(30))


def test_bytes_after_the_end_of_stream_marker_are_refused(tmp_path: Path) -> None:
    data = arrow_stream()
    root = place(tmp_path, "a.arrow", data + data)  # two streams one after another
    with pytest.raises(
        DataFormatError, match=rf"a\.arrow: {len(data)} bytes follow its end-of-stream marker at byte {len(data) - 8}"
    ):
        HfDatasetReader(root).shards()


def test_an_arrow_ipc_file_is_refused_naming_the_format(tmp_path: Path) -> None:
    table = pa.table({"i": [1, 2, 3]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    root = place(tmp_path, "a.arrow", bytes(sink.getvalue()))
    with pytest.raises(DataFormatError, match=r"a\.arrow: an Arrow IPC file \(ARROW1 magic\).*IPC streams"):
        HfDatasetReader(root).shards()


# ---- tar (WebDatasetReader) -------------------------------------------------------------------------
def small_member_tar(samples: int = 10) -> tuple[bytes, list[dict[str, Any]]]:
    """A shard written by Python's tarfile (as webdataset's TarWriter does): each sample a text and a
    class member, and the samples as read back from the whole file."""
    buf = io.BytesIO()
    expected = []
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for k in range(samples):
            sample: dict[str, Any] = {"__key__": f"s{k:03d}"}
            for field, data in (("txt", b"t" * (k * 37 % 300)), ("cls", str(k).encode())):
                info = tarfile.TarInfo(f"s{k:03d}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                sample[field] = data
            expected.append(sample)
    return buf.getvalue(), expected


def members_end(data: bytes) -> int:
    """Where the end-of-archive marker of a whole tar starts (after the last member's padded data)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        last = tar.getmembers()[-1]
    return last.offset_data + -(-last.size // 512) * 512


def test_tar_cut_anywhere_reads_every_sample_or_refuses(tmp_path: Path) -> None:
    """A shard cut at 200 random offsets, at every block boundary and at every byte around the ends
    of its members and of its end-of-archive marker: each cut either raises DataFormatError naming
    the file or gives exactly the whole shard (a cut in the record padding after the end-of-archive
    marker), never fewer samples or fields."""
    data, expected = small_member_tar()
    end = members_end(data)
    rng = random.Random(42)
    cuts = {rng.randrange(len(data)) for _ in range(200)} | set(range(0, len(data), 512))
    cuts |= (
        {end + k for k in range(-520, -500)} | {end + k for k in range(-8, 9)} | {end + k for k in range(1016, 1033)}
    )
    whole = refused = 0
    for cut in sorted(cuts):
        got = outcome(WebDatasetReader, place(tmp_path, "a.tar", data[:cut]), "a.tar")
        if got is None:
            refused += 1
        else:
            assert got == [expected], f"cut at byte {cut}"
            whole += 1
            assert cut >= end + 1024, f"cut at byte {cut} inside the end-of-archive marker was accepted"
    assert whole and refused
    with tarfile.open(fileobj=io.BytesIO(data[: end - 1024])) as tar:  # what tarfile itself does
        assert len(tar.getmembers()) < 2 * len(expected)  # members lost without an error


def test_tar_without_record_padding_reads_whole(tmp_path: Path) -> None:
    """Writers pad an archive to whole records (10240 bytes) or not: both are whole archives."""
    data, expected = small_member_tar()
    root = place(tmp_path, "a.tar", data[: members_end(data) + 1024])
    assert read_all(WebDatasetReader(root)) == [expected]


@pytest.mark.parametrize("damage", ["garbled", "zeroed"])
def test_tar_header_damaged_mid_archive_is_refused(tmp_path: Path, damage: str) -> None:
    """tarfile ends an archive silently at a header whose checksum fails or that is all zeros (a
    hole): the samples after it would be lost without an error."""
    data, expected = small_member_tar()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        header = tar.getmembers()[7].offset
    bad = bytearray(data)
    if damage == "garbled":
        bad[header + 3] ^= 0x20  # a letter of the member's name
    else:
        bad[header : header + 512] = bytes(512)
    with tarfile.open(fileobj=io.BytesIO(bytes(bad))) as tar:
        assert len(tar.getmembers()) == 7  # tarfile: no error, members lost
    root = place(tmp_path, "a.tar", bytes(bad))
    with pytest.raises(DataFormatError, match=rf"a\.tar: damaged: the block at byte {header} is neither"):
        WebDatasetReader(root).shards()


# ---- cached indexes ---------------------------------------------------------------------------------
INDEXED = {"jsonl": 2, "jsonl.gz": 2, "hf": 3, "tar": 0}  # 8-byte columns of the index table (tar: JSON)


def swap_entries(fmt: str, payload: bytes) -> bytes:
    """The index payload with two entries swapped (rows of the table, samples of the tar index)."""
    if fmt == "tar":
        samples = json.loads(payload)
        samples[1], samples[2] = samples[2], samples[1]
        return json.dumps(samples).encode()
    table = np.frombuffer(payload, dtype="<i8").reshape(-1, INDEXED[fmt]).copy()
    table[[1, 2]] = table[[2, 1]]
    return table.tobytes()


def edit_index(path: Path, edit: Callable[[bytes], bytes], *, fix_checksum: bool) -> None:
    """Rewrite the payload of a cached index (magic line, JSON header line, payload), keeping or
    recomputing the checksum its header records."""
    raw = path.read_bytes()
    head_start = raw.index(b"\n") + 1
    head_end = raw.index(b"\n", head_start)
    meta = json.loads(raw[head_start:head_end])
    payload = edit(raw[head_end + 1 :])
    assert meta["payload_bytes"] == len(payload)
    if fix_checksum:
        meta["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    path.write_bytes(raw[:head_start] + json.dumps(meta).encode() + b"\n" + payload)


@pytest.mark.parametrize("fix_checksum", [False, True], ids=["bit-rot", "tampered-with-checksum"])
@pytest.mark.parametrize("fmt", sorted(INDEXED))
def test_an_index_with_swapped_entries_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fmt: str, fix_checksum: bool
) -> None:
    """Entries swapped in a cached index (bit rot, tampering) would return samples out of order: the
    index's checksum, or where it was recomputed the index's own order, shows it; it is rebuilt."""
    spec = FORMATS[fmt]
    expected = spec.write(tmp_path, [150, 150, 150] if spec.equal_sizes else [150, 40, 90])
    assert read_all(spec.reader(tmp_path)) == expected  # builds the indexes
    reader = spec.reader(tmp_path)
    first = sorted(p for p in tmp_path.iterdir() if p.name.endswith(reader.suffixes))[0]
    index = first.with_name(first.name + INDEX_SUFFIX)
    edit_index(index, lambda payload: swap_entries(fmt, payload), fix_checksum=fix_checksum)
    with caplog.at_level(logging.INFO, logger="uc_checkpoint"):
        assert read_all(spec.reader(tmp_path)) == expected
    if not fix_checksum:
        assert f"data index {index} is damaged" in caplog.text


# ---- Parquet ----------------------------------------------------------------------------------------
def parquet_rows(n: int = 300) -> list[dict[str, Any]]:
    return [{"i": k, "t": f"text-{k:04d}"} for k in range(n)]


def test_parquet_page_checksums_are_verified(tmp_path: Path) -> None:
    """A byte flipped in a data page: pyarrow's default read returns the altered value silently;
    the page's CRC (written by pyarrow with write_page_checksum, by Spark by default) shows it, and
    the reader verifies it."""
    rows = parquet_rows()
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, compression="none", write_page_checksum=True)
    data = bytearray(path.read_bytes())
    at = bytes(data).index(b"text-0123")
    data[at + 8] ^= 0x01  # "text-0123" -> "text-0122"
    path.write_bytes(bytes(data))
    assert pq.read_table(path).to_pylist()[123]["t"] == "text-0122"
    with pytest.raises(DataFormatError, match=r"a\.parquet: cannot read row group 0: .*CRC"):
        read_all(ParquetReader(tmp_path))


def test_parquet_invalid_text_is_refused(tmp_path: Path) -> None:
    """A damaged string value (no page checksum to show it) is refused when decoded, naming the file."""
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(parquet_rows()), path, compression="none")
    data = bytearray(path.read_bytes())
    data[bytes(data).index(b"text-0123") + 1] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataFormatError, match=r"a\.parquet: cannot read row group 0"):
        read_all(ParquetReader(tmp_path))


def test_parquet_cut_anywhere_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "src.parquet"
    pq.write_table(pa.Table.from_pylist(parquet_rows()), path, row_group_size=100)
    data = path.read_bytes()
    rng = random.Random(7)
    for cut in sorted({rng.randrange(len(data)) for _ in range(60)} | {0, 4, len(data) - 1}):
        assert outcome(ParquetReader, place(tmp_path, "a.parquet", data[:cut]), "a.parquet") is None, cut


# ---- tokens and gzip --------------------------------------------------------------------------------
def test_npy_cut_anywhere_is_refused(tmp_path: Path) -> None:
    """numpy's header says how many tokens follow: any shorter file is refused (a longer one is read
    as numpy reads it, ignoring the excess)."""
    path = tmp_path / "src.npy"
    np.save(path, np.arange(200, dtype=np.uint16))
    data = path.read_bytes()
    rng = random.Random(5)
    for cut in sorted(set(range(140)) | {rng.randrange(len(data)) for _ in range(40)} | {len(data) - 1}):
        assert outcome(lambda r: TokenReader(r, seq_len=7), place(tmp_path, "a.npy", data[:cut]), "a.npy") is None, cut
    got = outcome(lambda r: TokenReader(r, seq_len=7), place(tmp_path, "a.npy", data + b"\x00" * 3), "a.npy")
    assert got is not None and len(got[0]) == 25


def test_gzip_zero_padding_is_read_and_garbage_refused(tmp_path: Path) -> None:
    """Python's gzip skips zero bytes after a member (tape padding) and refuses anything else there."""
    lines = [json.dumps({"k": k}) + "\n" for k in range(40)]
    data = gzip.compress("".join(lines[:20]).encode()) + gzip.compress("".join(lines[20:]).encode())
    padded = data + bytes(600)
    assert gzip.decompress(padded).decode().splitlines(keepends=True) == lines
    got = outcome(GzipJsonlReader, place(tmp_path, "a.jsonl.gz", padded), "a.jsonl.gz")
    assert got == [[json.loads(line) for line in lines]]
    with pytest.raises(gzip.BadGzipFile):
        gzip.decompress(data + b"junk")
    assert outcome(GzipJsonlReader, place(tmp_path, "a.jsonl.gz", data + b"junk"), "a.jsonl.gz") is None
