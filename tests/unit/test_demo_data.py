"""Tests for uc_checkpoint.demo.data: corpus, shard building, index validation, samples."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from uc_checkpoint.data.readers import TokenReader
from uc_checkpoint.demo import data
from uc_checkpoint.demo.data import (
    INDEX_NAME,
    ShardInfo,
    ShardSet,
    build_shards,
    read_corpus,
    samples_in_shard,
    split_sizes,
    stdlib_sources,
)

SMALL = 1 << 20  # 1 MiB of real stdlib text keeps the tests quick


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> ShardSet:
    return build_shards(tmp_path_factory.mktemp("shards"), num_shards=8, max_bytes=SMALL)


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return read_corpus(SMALL)


def _fake_tree(root: Path) -> None:
    files = {
        "b.py": b"print('b')\n",
        "a.py": b"x = 1\n",
        "pkg/__init__.py": b"",
        "pkg/z.py": b"z = 26\n",
        "site-packages/evil.py": b"raise SystemExit\n",
        "pkg/dist-packages/evil2.py": b"raise SystemExit\n",
        "notes.txt": b"not python\n",
    }
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def test_stdlib_sources_order_and_exclusions(tmp_path: Path) -> None:
    _fake_tree(tmp_path)
    rels = [rel for rel, _ in stdlib_sources(tmp_path)]
    assert rels == ["a.py", "b.py", "pkg/__init__.py", "pkg/z.py"]


def test_real_stdlib_sources_are_sorted_python_files() -> None:
    sources = stdlib_sources()
    rels = [rel for rel, _ in sources]
    assert len(rels) > 100
    assert rels == sorted(rels)
    assert all(rel.endswith(".py") for rel in rels)
    assert not any({"site-packages", "dist-packages"} & set(rel.split("/")) for rel in rels)


def test_read_corpus_concatenates_and_truncates(tmp_path: Path) -> None:
    _fake_tree(tmp_path)
    full = b"x = 1\n" + b"print('b')\n" + b"" + b"z = 26\n"
    assert read_corpus(10_000, tmp_path) == full
    assert read_corpus(9, tmp_path) == full[:9]
    with pytest.raises(ValueError):
        read_corpus(0, tmp_path)


def test_real_corpus_has_requested_size(corpus: bytes) -> None:
    assert len(corpus) == SMALL
    first_rel, first_path = stdlib_sources()[0]
    head = first_path.read_bytes()[:SMALL]
    assert corpus.startswith(head), first_rel


def test_build_is_deterministic(tmp_path: Path) -> None:
    one = build_shards(tmp_path / "one", num_shards=5, max_bytes=SMALL)
    two = build_shards(tmp_path / "two", num_shards=5, max_bytes=SMALL)
    assert one.shards == two.shards
    assert (one.root / INDEX_NAME).read_bytes() == (two.root / INDEX_NAME).read_bytes()
    for info in one.shards:
        assert (one.root / info.name).read_bytes() == (two.root / info.name).read_bytes()


def test_build_writes_index_with_provenance(built: ShardSet, corpus: bytes) -> None:
    index = json.loads((built.root / INDEX_NAME).read_text())
    assert index["python_version"]
    assert Path(index["source_root"]) == data.stdlib_root()
    assert index["total_bytes"] == len(corpus)
    assert index["corpus_sha256"] == hashlib.sha256(corpus).hexdigest()
    assert [e["name"] for e in index["shards"]] == [f"shard_{i:05d}.bin" for i in range(8)]
    for entry in index["shards"]:
        content = (built.root / entry["name"]).read_bytes()
        assert len(content) == entry["size"]
        assert hashlib.sha256(content).hexdigest() == entry["sha256"]
    # No temporary files are left behind.
    assert sorted(p.name for p in built.root.iterdir()) == sorted([INDEX_NAME] + [e["name"] for e in index["shards"]])


def test_shards_concatenate_to_corpus(built: ShardSet, corpus: bytes) -> None:
    joined = b"".join((built.root / info.name).read_bytes() for info in built.shards)
    assert joined == corpus
    assert built.total_bytes == len(corpus)


def test_shard_sizes_are_uneven_but_close(built: ShardSet) -> None:
    sizes = [info.size for info in built.shards]
    assert len(set(sizes)) == len(sizes)  # no two equal
    mean = sum(sizes) / len(sizes)
    assert all(0.7 * mean <= size <= 1.3 * mean for size in sizes), sizes


def test_build_reuses_matching_shards(tmp_path: Path) -> None:
    first = build_shards(tmp_path, num_shards=3, max_bytes=SMALL)
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    second = build_shards(tmp_path, num_shards=3, max_bytes=SMALL)
    assert second == first
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == stamps


def test_build_repairs_corrupted_shard(tmp_path: Path) -> None:
    first = build_shards(tmp_path, num_shards=3, max_bytes=SMALL)
    victim = tmp_path / first.shards[1].name
    victim.write_bytes(b"garbage")
    second = build_shards(tmp_path, num_shards=3, max_bytes=SMALL)
    assert second.shards == first.shards
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == first.shards[1].sha256


def test_build_with_other_shard_count_replaces_old_set(tmp_path: Path) -> None:
    build_shards(tmp_path, num_shards=6, max_bytes=SMALL)
    smaller = build_shards(tmp_path, num_shards=2, max_bytes=SMALL)
    assert len(smaller.shards) == 2
    assert sorted(p.name for p in tmp_path.glob("shard_*.bin")) == [
        "shard_00000.bin",
        "shard_00001.bin",
    ]
    assert ShardSet.load(tmp_path) == smaller


def test_build_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_shards(tmp_path / "a", num_shards=0, max_bytes=SMALL)
    with pytest.raises(ValueError):
        build_shards(tmp_path / "b", num_shards=2, max_bytes=0)
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.py").write_bytes(b"ab")
    with pytest.raises(ValueError, match="too few"):
        build_shards(tmp_path / "c", num_shards=3, max_bytes=SMALL, source_root=src)


def test_split_sizes_examples() -> None:
    assert split_sizes(10, 1) == [10]
    sizes = split_sizes(1000, 2)
    assert sum(sizes) == 1000 and sizes[0] != sizes[1]
    with pytest.raises(ValueError):
        split_sizes(100, 0)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(min_value=1, max_value=10**9), num_shards=st.integers(1, 40))
def test_split_sizes_properties(total: int, num_shards: int) -> None:
    try:
        sizes = split_sizes(total, num_shards)
    except ValueError:
        assert total < 4 * num_shards  # only tiny totals may fail
        return
    assert len(sizes) == num_shards
    assert sum(sizes) == total
    assert min(sizes) >= 1


def test_load_round_trip(built: ShardSet) -> None:
    loaded = ShardSet.load(built.root)
    assert loaded == built
    assert loaded.path(0) == built.root / "shard_00000.bin"
    with pytest.raises(IndexError):
        loaded.path(len(loaded.shards))


def _copy_set(src: ShardSet, dst: Path) -> ShardSet:
    dst.mkdir()
    for path in src.root.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return ShardSet.load(dst)


def test_load_detects_size_mismatch(built: ShardSet, tmp_path: Path) -> None:
    copy = _copy_set(built, tmp_path / "c")
    victim = copy.root / copy.shards[2].name
    with open(victim, "ab") as fh:
        fh.write(b"!")
    with pytest.raises(ValueError, match=copy.shards[2].name) as excinfo:
        ShardSet.load(copy.root)
    assert "size" in str(excinfo.value)


def test_load_detects_hash_mismatch(built: ShardSet, tmp_path: Path) -> None:
    copy = _copy_set(built, tmp_path / "c")
    victim = copy.root / copy.shards[0].name
    content = bytearray(victim.read_bytes())
    content[100] ^= 0xFF
    victim.write_bytes(bytes(content))
    with pytest.raises(ValueError, match=copy.shards[0].name) as excinfo:
        ShardSet.load(copy.root)
    assert "sha256" in str(excinfo.value)
    # Size-only validation does not notice a same-size change.
    assert ShardSet.load(copy.root, verify_hashes=False).shards == copy.shards


def test_load_detects_missing_shard(built: ShardSet, tmp_path: Path) -> None:
    copy = _copy_set(built, tmp_path / "c")
    (copy.root / copy.shards[-1].name).unlink()
    with pytest.raises(ValueError, match=copy.shards[-1].name):
        ShardSet.load(copy.root)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda index: "{not json",
        lambda index: json.dumps({**index, "shards": None}),
        lambda index: json.dumps({**index, "shards": []}),
        lambda index: json.dumps({**index, "shards": [{"name": "shard_00000.bin"}]}),
        lambda index: json.dumps({**index, "shards": [{**index["shards"][0], "name": "../outside.bin"}]}),
    ],
)
def test_load_rejects_malformed_index(built: ShardSet, tmp_path: Path, mutate: Any) -> None:
    copy = _copy_set(built, tmp_path / "c")
    index_path = copy.root / INDEX_NAME
    index_path.write_text(mutate(json.loads(index_path.read_text())))
    with pytest.raises(ValueError, match=INDEX_NAME):
        ShardSet.load(copy.root)


def test_load_without_index(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ShardSet.load(tmp_path)


def test_samples_in_shard() -> None:
    assert samples_in_shard(0, 4) == 0
    assert samples_in_shard(4, 4) == 0
    assert samples_in_shard(5, 4) == 1
    assert samples_in_shard(14, 4) == 2
    assert samples_in_shard(15, 4) == 3
    with pytest.raises(ValueError):
        samples_in_shard(10, 0)
    with pytest.raises(ValueError):
        samples_in_shard(-1, 4)


@pytest.mark.parametrize("seq_len", [1, 127, 128, 1000])
def test_the_token_reader_reads_the_shards_windows(built: ShardSet, corpus: bytes, seq_len: int) -> None:
    """The demo reads its byte shards through the flat-token reader (uint8): sample j of a shard is
    its j-th window of seq_len + 1 bytes, as the corpus has it."""
    width = seq_len + 1
    reader = TokenReader(built.root, seq_len, dtype="uint8", files=[info.name for info in built.shards])
    specs = reader.shards()
    assert [s.num_samples for s in specs] == list(built.samples_per_shard(seq_len))
    offset = 0
    for shard, info in enumerate(built.shards):
        count = samples_in_shard(info.size, seq_len)
        assert specs[shard].num_samples == count == info.size // width
        for j in sorted({0, 1, count // 2, count - 1}):
            expected = np.frombuffer(corpus[offset + j * width : offset + (j + 1) * width], np.uint8)
            (got,) = reader(specs[shard], j, j + 1)
            assert got.dtype == np.int64 and got.shape == (width,)
            assert np.array_equal(got, expected)
        offset += info.size


def test_an_empty_shard_has_no_samples(tmp_path: Path) -> None:
    (tmp_path / "shard_00000.bin").write_bytes(b"")
    (spec,) = TokenReader(tmp_path, 8, dtype="uint8").shards()
    assert spec.num_samples == 0


def test_shard_info_is_frozen() -> None:
    info = ShardInfo("shard_00000.bin", 1, "00")
    with pytest.raises(AttributeError):
        info.size = 2  # type: ignore[misc]
