"""JSON Lines: the cached line index (beside the file, or in staging for a read-only directory),
rebuilt when stale or damaged; empty lines; bad JSON; gzip members and the refusal to seek in a
one-member file."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from uc_checkpoint.data.readers import GzipJsonlReader, JsonlReader
from uc_checkpoint.data.readers.base import INDEX_SUFFIX
from uc_checkpoint.errors import DataFormatError


def test_index_is_cached_beside_the_file_and_reused(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"k": i}) + "\n" for i in range(50)))
    assert JsonlReader(tmp_path).shards()[0].num_samples == 50
    index = tmp_path / ("a.jsonl" + INDEX_SUFFIX)
    assert index.exists()
    reader = JsonlReader(tmp_path)
    reader._scan = None  # type: ignore[assignment,method-assign]  # a second discovery must not rescan
    assert reader.shards()[0].num_samples == 50


def test_stale_index_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"k": i}) + "\n" for i in range(50)))
    JsonlReader(tmp_path).shards()
    path.write_text("".join(json.dumps({"k": i}) + "\n" for i in range(70)))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    reader = JsonlReader(tmp_path)
    (shard,) = reader.shards()
    assert shard.num_samples == 70
    assert list(reader(shard, 65, 70)) == [{"k": i} for i in range(65, 70)]


def test_damaged_index_is_rebuilt(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"k": i}) + "\n" for i in range(20)))
    JsonlReader(tmp_path).shards()
    index = tmp_path / ("a.jsonl" + INDEX_SUFFIX)
    index.write_bytes(index.read_bytes()[:-5])
    assert JsonlReader(tmp_path).shards()[0].num_samples == 20


def test_remote_file_keeps_its_index_in_staging(staging: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/readers-staging/a.jsonl", b'{"a": 1}\n{"a": 2}\n')
    try:
        reader = JsonlReader("memory://readers-staging")
        (shard,) = reader.shards()
        assert list(reader(shard, 1, 2)) == [{"a": 2}]
        assert not fs.exists("/readers-staging/a.jsonl" + INDEX_SUFFIX)
        (index,) = staging.rglob("*" + INDEX_SUFFIX)
        assert index.name.endswith("a.jsonl" + INDEX_SUFFIX)
    finally:
        fs.rm("/readers-staging", recursive=True)


def test_empty_lines_are_not_samples_and_no_trailing_newline(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(b'\n{"a": 1}\r\n\r\n\n{"a": 2}\n\n{"a": 3}')
    reader = JsonlReader(tmp_path)
    (shard,) = reader.shards()
    assert shard.num_samples == 3
    assert list(reader(shard, 0, 3)) == [{"a": 1}, {"a": 2}, {"a": 3}]


def test_bad_json_names_file_and_sample(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    reader = JsonlReader(tmp_path)
    (shard,) = reader.shards()
    with pytest.raises(DataFormatError, match=r"a\.jsonl: sample 1 .* is not JSON"):
        list(reader(shard, 0, 3))


def test_gzip_seeks_within_a_member_up_to_max_skip(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:  # one member of 30 lines
        f.write("".join(json.dumps({"k": i}) + "\n" for i in range(30)))
    reader = GzipJsonlReader(tmp_path)
    (shard,) = reader.shards()
    assert shard.num_samples == 30
    assert list(reader(shard, 25, 28)) == [{"k": i} for i in range(25, 28)]
    with pytest.raises(
        DataFormatError, match=r"a\.jsonl\.gz: its gzip member at byte 0 holds 30 samples, more than max_skip=10"
    ):
        GzipJsonlReader(tmp_path, max_skip=10).shards()


def test_gzip_members_index(tmp_path: Path) -> None:
    with open(tmp_path / "a.jsonl.gz", "wb") as f:
        for k in range(0, 100, 10):
            f.write(gzip.compress("".join(json.dumps({"k": i}) + "\n" for i in range(k, k + 10)).encode()))
    reader = GzipJsonlReader(tmp_path, max_skip=10)
    (shard,) = reader.shards()
    assert reader._members("a.jsonl.gz")[:, 1].tolist() == list(range(0, 101, 10))
    assert list(reader(shard, 57, 63)) == [{"k": i} for i in range(57, 63)]


def test_gzip_truncated_and_not_gzip(tmp_path: Path) -> None:
    data = gzip.compress("".join(json.dumps({"k": i}) + "\n" for i in range(300)).encode())
    (tmp_path / "a.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFormatError, match=r"a\.jsonl\.gz.*truncated gzip"):
        GzipJsonlReader(tmp_path).shards()
    (tmp_path / "a.jsonl.gz").write_bytes(b"plain text\n")
    with pytest.raises(DataFormatError, match=r"a\.jsonl\.gz.*not valid gzip"):
        GzipJsonlReader(tmp_path).shards()
