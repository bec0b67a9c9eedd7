"""HfDatasetReader: rows counted from the Arrow stream's message headers (matching datasets'
own count), shard order from state.json, columns, damaged files and a missing pyarrow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import pytest

from uc_checkpoint.data.readers import HfDatasetReader
from uc_checkpoint.errors import DataFormatError


def save(path: Path, n: int = 2500, shards: int = 2) -> datasets.Dataset:
    ds = datasets.Dataset.from_dict({"i": list(range(n)), "t": [f"x{i}" for i in range(n)]})
    ds.save_to_disk(str(path), num_shards=shards)
    return ds


def test_counts_match_datasets_and_state_json_order(tmp_path: Path) -> None:
    ds = save(tmp_path / "d", n=5001, shards=2)
    reader = HfDatasetReader(tmp_path / "d")
    shards = reader.shards()
    state = json.loads((tmp_path / "d" / "state.json").read_text())
    assert [s.name for s in shards] == [d["filename"] for d in state["_data_files"]]
    assert sum(s.num_samples for s in shards) == ds.num_rows
    # rows that straddle record batches (datasets writes 1000-row batches)
    first = shards[0].num_samples
    assert list(reader(shards[1], 995, 1005)) == ds.select(range(first + 995, first + 1005)).to_list()


def test_columns(tmp_path: Path) -> None:
    save(tmp_path / "d", n=10, shards=1)
    reader = HfDatasetReader(tmp_path / "d", columns=["t"])
    (shard,) = reader.shards()
    assert list(reader(shard, 3, 4)) == [{"t": "x3"}]
    with pytest.raises(DataFormatError, match="no column"):
        list(HfDatasetReader(tmp_path / "d", columns=["zz"])(shard, 0, 1))


def test_truncated_arrow_file(tmp_path: Path) -> None:
    save(tmp_path / "d", n=3000, shards=1)
    (arrow,) = (tmp_path / "d").glob("*.arrow")
    data = arrow.read_bytes()
    arrow.write_bytes(data[: len(data) - 3000])
    with pytest.raises(DataFormatError, match=rf"{arrow.name}.*truncated"):
        HfDatasetReader(tmp_path / "d").shards()


def test_not_arrow(tmp_path: Path) -> None:
    (tmp_path / "data-00000-of-00001.arrow").write_bytes(b"\x00\x01\x02\x03" * 100)
    with pytest.raises(DataFormatError, match=r"data-00000-of-00001\.arrow"):
        HfDatasetReader(tmp_path).shards()


def test_missing_pyarrow_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install 'uc-checkpoint\[hf\]'"):
        HfDatasetReader(tmp_path)


def test_a_dataset_dict_root_is_refused_naming_its_splits(tmp_path: Path) -> None:
    """Reading every split of a DatasetDict as one dataset would mix test data into training."""
    d = datasets.Dataset.from_dict({"x": list(range(10))})
    datasets.DatasetDict({"train": d, "test": d}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataFormatError, match=r"dataset_dict\.json: a DatasetDict .*splits: .*train.*read one split"):
        HfDatasetReader(tmp_path / "dd").shards()
    (spec,) = HfDatasetReader(tmp_path / "dd" / "train").shards()
    assert spec.num_samples == 10
