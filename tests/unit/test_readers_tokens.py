"""TokenReader's bad inputs: a truncated .npy, a .bin of a size that is no whole number of tokens, a
dtype or seq_len that does not fit, non-token dtypes; and the window arithmetic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from uc_checkpoint.data.readers import TokenReader
from uc_checkpoint.errors import DataFormatError


def test_windows_do_not_overlap_and_the_tail_is_unused(tmp_path: Path) -> None:
    np.arange(53, dtype=np.uint8).tofile(tmp_path / "a.bin")
    reader = TokenReader(tmp_path, 9, dtype="uint8")
    (shard,) = reader.shards()
    assert shard.num_samples == 5  # 53 // 10
    windows = [w.tolist() for w in reader(shard, 0, 5)]
    assert windows[1] == list(range(10, 20)) and windows[4][-1] == 49
    assert next(reader(shard, 4, 5)).dtype == np.int64


def test_truncated_npy_names_the_file(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(1000, dtype=np.uint16))
    data = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "a.npy").write_bytes(data[:-10])
    with pytest.raises(DataFormatError, match=r"a\.npy.*truncated"):
        TokenReader(tmp_path, 7).shards()


def test_npy_header_damaged(tmp_path: Path) -> None:
    (tmp_path / "a.npy").write_bytes(b"not numpy at all" * 10)
    with pytest.raises(DataFormatError, match=r"a\.npy.*NUMPY magic"):
        TokenReader(tmp_path, 7).shards()


def test_npy_of_another_dtype_than_asked(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.uint32))
    with pytest.raises(DataFormatError, match=r"a\.npy.*uint32.*uint16"):
        TokenReader(tmp_path, 7, dtype="uint16").shards()


def test_float_npy_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros(100, dtype=np.float32))
    with pytest.raises(DataFormatError, match="not an integer token type"):
        TokenReader(tmp_path, 7).shards()


def test_bin_needs_a_dtype_and_a_whole_number_of_tokens(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"\0" * 1001)
    with pytest.raises(DataFormatError, match=r"a\.bin.*needs TokenReader\(dtype"):
        TokenReader(tmp_path, 7).shards()
    with pytest.raises(DataFormatError, match=r"a\.bin.*1001 bytes is not a whole number of uint16"):
        TokenReader(tmp_path, 7, dtype="uint16").shards()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        TokenReader("/tmp", 0)
    with pytest.raises(ValueError, match="dtype"):
        TokenReader("/tmp", 8, dtype="float32")


def test_file_shrunk_after_discovery(tmp_path: Path) -> None:
    np.arange(400, dtype=np.uint16).tofile(tmp_path / "a.bin")
    reader = TokenReader(tmp_path, 9, dtype="uint16")
    (shard,) = reader.shards()
    (tmp_path / "a.bin").write_bytes(b"\0" * 20)
    fresh = TokenReader(tmp_path, 9, dtype="uint16")
    with pytest.raises(Exception, match=r"a\.bin"):
        list(fresh(shard, 30, 40))


def test_an_empty_bin_has_no_samples_and_reads_as_empty(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"")
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "b.bin")
    reader = TokenReader(tmp_path, 4, dtype="uint16")
    empty, full = reader.shards()
    assert (empty.num_samples, full.num_samples) == (0, 4)
    assert list(reader(empty, 0, 0)) == []
    assert list(reader.read_indices(empty, np.array([], dtype=np.int64))) == []
