"""Every shard reader against files written by its format's own library: sample counts from
metadata, a slice from the middle equal to the library's full read, read_indices in the asked order,
pickling into workers, shards named relative to the location with content fingerprints, and a file
changed after discovery refused (by its version in a copy of the listing reader, by its content in a
reader that did not list it)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from tests.support.reader_data import FORMATS, plain
from tests.support.shard_edits import rewrite_with_other_samples
from uc_checkpoint.data.intervals import ShardSpec
from uc_checkpoint.errors import DataLoadingError, DatasetMismatchError

NAMES = sorted(FORMATS)


def sizes_for(fmt: str) -> list[int]:
    return [150, 150, 150] if FORMATS[fmt].equal_sizes else [150, 7, 301]


@pytest.fixture(params=NAMES)
def written(request: pytest.FixtureRequest, tmp_path: Path):
    fmt = request.param
    root = tmp_path / "data"
    root.mkdir()
    expected = FORMATS[fmt].write(root, sizes_for(fmt))
    return fmt, root, expected


def test_counts_and_names(written) -> None:
    fmt, root, expected = written
    shards = FORMATS[fmt].reader(root).shards()
    assert [s.num_samples for s in shards] == [len(e) for e in expected]
    reader = FORMATS[fmt].reader(root)
    assert [s.name for s in shards] == reader.shard_files()
    assert all((root / s.name).is_file() and not s.name.startswith("/") for s in shards)
    assert all(
        s.fingerprint == f"size={(root / s.name).stat().st_size},ends_sha256=" + s.fingerprint[-32:] for s in shards
    )


def test_middle_slice_equals_the_library_read(written) -> None:
    fmt, root, expected = written
    reader = FORMATS[fmt].reader(root)
    shard = reader.shards()[0]
    got = [plain(s) for s in reader(shard, 61, 133)]
    assert got == expected[0][61:133]
    assert [plain(s) for s in reader(shard, 0, shard.num_samples)] == expected[0]
    assert list(reader(shard, 5, 5)) == []


def test_read_indices_in_the_given_order(written) -> None:
    fmt, root, expected = written
    reader = FORMATS[fmt].reader(root)
    shard = reader.shards()[-1]
    if not reader.random_access:
        with pytest.raises(TypeError, match="sequentially"):
            reader.read_indices(shard, [1, 0])
        return
    order = np.random.default_rng(0).permutation(shard.num_samples)[:40]
    order = np.concatenate((order, [3, 4, 5, 0]))
    assert [plain(s) for s in reader.read_indices(shard, order)] == [expected[-1][i] for i in order]
    with pytest.raises(DataLoadingError, match="outside"):
        list(reader.read_indices(shard, [shard.num_samples]))


def test_pickled_reader_reads_the_same(written) -> None:
    fmt, root, expected = written
    reader = FORMATS[fmt].reader(root)
    shards = reader.shards()
    list(reader(shards[0], 0, 3))  # opens files and caches in this process
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.cache == {}
    assert [plain(s) for s in copy(shards[2], 2, 6)] == expected[2][2:6]


def test_range_outside_the_shard_and_foreign_shard(written) -> None:
    fmt, root, _ = written
    reader = FORMATS[fmt].reader(root)
    shard = reader.shards()[1]
    with pytest.raises(DataLoadingError, match="outside"):
        reader(shard, 0, shard.num_samples + 1)
    for foreign in (str(root / shard.name), f"s3://bucket/{shard.name}", f"../{shard.name}"):
        with pytest.raises(DataLoadingError, match="not a name relative to"):
            reader(ShardSpec(foreign, 3), 0, 1)


def test_file_touched_after_discovery_is_refused_by_a_copy_of_the_listing_reader(written) -> None:
    """A worker's copy of the reader that listed the shards (pickled: spawned; the same object:
    forked or the main process) checks the file's version before its first read."""
    fmt, root, expected = written
    reader = FORMATS[fmt].reader(root)
    shards = reader.shards()
    copy = pickle.loads(pickle.dumps(reader))
    path = root / shards[0].name
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    for same_listing in (copy, reader):
        with pytest.raises(DatasetMismatchError, match=f"{path}.*changed since its shard list was made"):
            list(same_listing(shards[0], 0, 1))
    # Only the version changed: a reader that did not list the shards checks the content, which is the same.
    assert [plain(s) for s in FORMATS[fmt].reader(root)(shards[0], 0, 2)] == expected[0][:2]
    assert FORMATS[fmt].reader(root).shards()[0].fingerprint == shards[0].fingerprint


def test_file_rewritten_after_discovery_is_refused_by_content(written, tmp_path: Path) -> None:
    fmt, root, _ = written
    shards = FORMATS[fmt].reader(root).shards()
    name = rewrite_with_other_samples(fmt, root, 0, tmp_path / "other")
    fresh = FORMATS[fmt].reader(root)  # did not list the shards: compares content fingerprints
    with pytest.raises(DatasetMismatchError, match=f"{root / name}.*content fingerprint"):
        list(fresh(shards[0], 0, 1))
    assert fresh.shards()[0].fingerprint != shards[0].fingerprint
