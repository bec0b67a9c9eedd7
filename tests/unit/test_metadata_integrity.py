"""Every byte of a checkpoint is covered (issue 14): a checksum trailer over the whole ``.metadata``
(stock ``FileSystemReader`` ignores it) and structural checks of what a load would write, so that a
single flipped byte anywhere in a checkpoint (``.metadata`` or a data file) is never a silently
wrong load: it raises ``CorruptCheckpointError`` naming the file, or (rarely) changes nothing."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from uc_checkpoint import UCVolumeReader, UCVolumeWriter, verify_checkpoint
from uc_checkpoint.dcp.metadata_io import TRAILER_PREFIX, dump_metadata, load_metadata
from uc_checkpoint.dcp.options import ReaderOptions
from uc_checkpoint.errors import CorruptCheckpointError, rank_error


def _sd() -> dict:
    return {
        "a": torch.arange(10.0),
        "m": torch.randn(64, 33, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
        "big": torch.arange(70_000, dtype=torch.float32),  # above the 256 KiB small-item path
        "ids": torch.arange(7, dtype=torch.int64),
        "extra": {"step": 3, "name": "run"},
    }


def _blank() -> dict:
    return {
        "a": torch.zeros(10),
        "m": torch.zeros(64, 33, dtype=torch.bfloat16),
        "big": torch.zeros(70_000),
        "ids": torch.zeros(7, dtype=torch.int64),
        "extra": {"step": None, "name": None},
    }


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("a", "m", "big", "ids")) and a["extra"] == b["extra"]


def _load(loc: Path, **kwargs: object) -> dict:
    out = _blank()
    dcp.load(out, storage_reader=UCVolumeReader(loc, options=ReaderOptions(**kwargs)), no_dist=True)
    return out


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    loc = tmp_path / "ckpt"
    dcp.save(_sd(), storage_writer=UCVolumeWriter(loc), no_dist=True)
    return loc


def _error(loc: Path, **kwargs: object) -> BaseException | None:
    try:
        _load(loc, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - DCP wraps ours in a BaseException
        return rank_error(exc)
    return None


def test_metadata_ends_with_a_trailer_stock_readers_ignore(saved: Path) -> None:
    raw = (saved / ".metadata").read_bytes()
    assert TRAILER_PREFIX in raw[-100:] and raw.endswith(b"\n")
    out = _blank()
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(saved)), no_dist=True)
    assert _equal(out, _sd())


def _rewrite_chunk(saved: Path, resign: bool, **change: object) -> None:
    meta = load_metadata((saved / ".metadata").read_bytes(), "m")
    md = meta.state_dict_metadata["a"]
    md.chunks[0] = dataclasses.replace(md.chunks[0], **change)
    data = dump_metadata(meta) if resign else pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    (saved / ".metadata").write_bytes(data)


@pytest.mark.parametrize("resign", [True, False], ids=["trailer-recomputed", "trailer-dropped"])
@pytest.mark.parametrize(
    "change",
    [{"sizes": torch.Size([9])}, {"offsets": torch.Size([1])}, {"sizes": torch.Size([11])}],
    ids=["shrunk", "shifted", "grown"],
)
def test_a_chunk_that_no_longer_tiles_its_tensor_is_refused(saved: Path, resign: bool, change: dict) -> None:
    _rewrite_chunk(saved, resign, **change)
    err = _error(saved)
    assert isinstance(err, CorruptCheckpointError) and str(saved / ".metadata") in str(err), err
    assert not verify_checkpoint(str(saved)).ok


def test_structural_checks_cover_stock_checkpoints(tmp_path: Path) -> None:
    # No manifest and no trailer: what a load would write is still checked.
    loc = tmp_path / "stock"
    dcp.save(_sd(), storage_writer=dcp.FileSystemWriter(str(loc)), no_dist=True)
    meta = pickle.loads((loc / ".metadata").read_bytes())
    md = meta.state_dict_metadata["a"]
    md.chunks[0] = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([9]))
    (loc / ".metadata").write_bytes(pickle.dumps(meta))
    err = _error(loc)
    assert isinstance(err, CorruptCheckpointError) and "'a'" in str(err) and "covering 9 elements" in str(err), err


def test_an_item_stored_in_fewer_bytes_than_its_data_is_refused(saved: Path) -> None:
    meta = load_metadata((saved / ".metadata").read_bytes(), "m")
    index = MetadataIndex("big", torch.Size([0]))
    meta.storage_data[index] = dataclasses.replace(meta.storage_data[index], length=1000)
    (saved / ".metadata").write_bytes(dump_metadata(meta))
    err = _error(saved)
    assert isinstance(err, CorruptCheckpointError) and "'big'" in str(err) and "fewer than" in str(err), err


def _metadata_refused(loc: Path, **kwargs: object) -> bool:
    """Whether the reader's ``read_metadata()``, the first thing ``dcp.load`` asks of it, refuses the
    ``.metadata`` with a CorruptCheckpointError naming ``loc``: then the load raises that very error,
    so the sweep runs a whole load only for the flips ``read_metadata()`` lets through."""
    try:
        UCVolumeReader(loc, options=ReaderOptions(**kwargs)).read_metadata()
    except CorruptCheckpointError as exc:
        return str(loc) in str(exc)
    return False


def _flip_sweep(path: Path, positions: list[int], loc: Path, **kwargs: object) -> dict[str, int]:
    original = path.read_bytes()
    want = _sd()
    counts = {"refused": 0, "unchanged": 0, "wrong": 0, "other": 0}
    others: list[str] = []
    for pos in positions:
        data = bytearray(original)
        data[pos] ^= 0xFF
        path.write_bytes(bytes(data))
        if path.name == ".metadata" and _metadata_refused(loc, **kwargs):
            counts["refused"] += 1
            continue
        try:
            got = _load(loc, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            err = rank_error(exc)
            # Named: the damaged file, or the data file a damaged .metadata sent the load to.
            if isinstance(err, CorruptCheckpointError) and str(loc) in str(err):
                counts["refused"] += 1
            else:
                counts["other"] += 1
                others.append(f"{pos}: {type(err).__name__}: {str(err)[:200]}")
        else:
            counts["unchanged" if _equal(got, want) else "wrong"] += 1
    path.write_bytes(original)
    assert counts["wrong"] == 0 and counts["other"] == 0, (counts, others[:5])
    return counts


def test_no_single_byte_flip_in_metadata_loads_wrong_values(saved: Path) -> None:
    meta = saved / ".metadata"
    size = meta.stat().st_size
    counts = _flip_sweep(meta, list(range(size)), saved)
    assert counts["refused"] == size  # every flip is caught, by the trailer's checksum or its format


@pytest.mark.parametrize("prefetch", [True, False])
def test_no_single_byte_flip_in_a_data_file_loads_wrong_values(saved: Path, prefetch: bool) -> None:
    for data_file in sorted(saved.glob("*.distcp")):
        size = data_file.stat().st_size
        step = max(1, size // 150)
        counts = _flip_sweep(data_file, list(range(0, size, step)) + [size - 1], saved, prefetch_files=prefetch)
        assert counts["refused"] > 0


def test_no_single_byte_flip_in_a_stock_checkpoints_metadata_loads_wrong_values(tmp_path: Path) -> None:
    # Stock FileSystemWriter: no trailer, no manifest. The structural checks and the reader's own
    # decoding checks must still turn every flip into a clear error or an unchanged load.
    loc = tmp_path / "stock"
    dcp.save(_sd(), storage_writer=dcp.FileSystemWriter(str(loc)), no_dist=True)
    meta = loc / ".metadata"
    counts = _flip_sweep(meta, list(range(0, meta.stat().st_size, 3)), loc)
    assert counts["refused"] > 0


@pytest.mark.parametrize("prefetch", [True, False])
def test_no_flip_in_a_large_item_of_a_stock_checkpoint_loads_wrong_values(tmp_path: Path, prefetch: bool) -> None:
    # No manifest: the archive's own CRC-32 is the only check, and torch.load does not make it.
    loc = tmp_path / "stock"
    dcp.save(_sd(), storage_writer=dcp.FileSystemWriter(str(loc)), no_dist=True)
    for data_file in sorted(loc.glob("*.distcp")):
        size = data_file.stat().st_size
        counts = _flip_sweep(data_file, list(range(0, size, max(1, size // 120))), loc, prefetch_files=prefetch)
        assert counts["refused"] > 0
