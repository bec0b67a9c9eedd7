"""ParquetReader: counts from the footer alone, reads only the row groups asked for, bad files and a
missing pyarrow."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from uc_checkpoint.data.readers import ParquetReader
from uc_checkpoint.errors import DataFormatError


def write(path: Path, n: int = 1000, group: int = 100) -> pa.Table:
    table = pa.table({"i": list(range(n)), "s": [f"r{i}" for i in range(n)]})
    pq.write_table(table, path, row_group_size=group)
    return table


def test_columns_and_row_groups_read(tmp_path: Path) -> None:
    table = write(tmp_path / "a.parquet")
    reader = ParquetReader(tmp_path, columns=["s"], cached_row_groups=1)
    (shard,) = reader.shards()
    read: list[int] = []
    pf, _ = reader._parquet("a.parquet")
    original = pf.read_row_group
    pf.read_row_group = lambda g, **kw: (read.append(g), original(g, **kw))[1]
    assert list(reader(shard, 250, 260)) == [{"s": f"r{i}"} for i in range(250, 260)]
    assert read == [2]
    assert list(reader.read_indices(shard, [905, 5, 901])) == [{"s": "r905"}, {"s": "r5"}, {"s": "r901"}]
    assert sorted(read) == [0, 2, 9]  # each touched row group once, whatever the order
    assert table.num_rows == shard.num_samples


def test_missing_column(tmp_path: Path) -> None:
    write(tmp_path / "a.parquet")
    with pytest.raises(DataFormatError, match=r"a\.parquet.*no column.*'nope'"):
        ParquetReader(tmp_path, columns=["nope"]).shards()


def test_truncated_file_names_it(tmp_path: Path) -> None:
    write(tmp_path / "a.parquet")
    data = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "a.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFormatError, match=r"a\.parquet.*not a readable Parquet"):
        ParquetReader(tmp_path).shards()


def test_missing_pyarrow_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # an import that fails as when not installed
    with pytest.raises(ImportError, match=r"pip install 'uc-checkpoint\[parquet\]'"):
        ParquetReader(tmp_path)
