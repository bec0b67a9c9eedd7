"""Decoding load-plan items from their bytes (``uc_checkpoint.dcp.items``), without ``dcp.load``: a
recording planner stands in for DCP's, and the bytes are ``torch.save`` archives as DCP writes them."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from uc_checkpoint.dcp.compat import _StorageInfo
from uc_checkpoint.dcp.items import ItemLoader, MemoryReader, zip_crc_problem
from uc_checkpoint.errors import CorruptCheckpointError
from uc_checkpoint.volumes import LocalVolume


class Planner:
    """The three planner calls an item loader makes, recorded."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: dict[str, torch.Tensor] = {}
        self.bytes: dict[str, bytes] = {}

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        self.bytes[req.storage_index.fqn] = value.read()

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        return self.targets[req.storage_index.fqn]

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed[req.storage_index.fqn] = tensor


def _archive(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _item(fqn: str, kind: LoadItemType = LoadItemType.TENSOR, shape: tuple[int, ...] = (4,)) -> ReadItem:
    zeros = torch.Size([0] * len(shape)) if kind == LoadItemType.TENSOR else torch.Size([])
    index = MetadataIndex(fqn, zeros if kind == LoadItemType.TENSOR else None)
    return ReadItem(kind, index, zeros, index, zeros, torch.Size(shape) if kind == LoadItemType.TENSOR else zeros)


def _file(tmp_path: Path, blobs: dict[ReadItem, bytes]) -> tuple[bytes, dict[Any, _StorageInfo]]:
    """The blobs laid end to end in one data file ``data.distcp``, and where each lies."""
    data = b""
    where: dict[Any, _StorageInfo] = {}
    for item, blob in blobs.items():
        where[item.storage_index] = _StorageInfo("data.distcp", len(data), len(blob))
        data += blob
    return data, where


def _loader(tmp_path: Path, planner: Planner, where: dict[Any, _StorageInfo], **kwargs: Any) -> ItemLoader:
    kwargs.setdefault("check_archive_crc", False)
    return ItemLoader(LocalVolume(tmp_path / "ckpt"), planner, where, {}, transforms=None, **kwargs)  # type: ignore[arg-type]


def test_items_of_a_file_and_of_a_range(tmp_path: Path) -> None:
    w, b = _item("w"), _item("b")
    extra = _item("extra", LoadItemType.BYTE_IO)
    blobs = {w: _archive(torch.arange(4.0)), extra: b"opaque bytes", b: _archive(torch.ones(4))}
    data, where = _file(tmp_path, blobs)
    items = [w, extra, b]

    planner = Planner({"w": torch.zeros(4), "b": torch.zeros(4)})
    loader = _loader(tmp_path, planner, where)
    assert loader.by_file(items) == {"data.distcp": items}
    assert loader.spans(items) == [("data.distcp", where[i.storage_index].offset, len(blobs[i]), i) for i in items]
    path = tmp_path / "data.distcp"
    path.write_bytes(data)
    loader.load_file(items, path)
    assert torch.equal(planner.committed["w"], torch.arange(4.0)) and torch.equal(planner.committed["b"], torch.ones(4))
    assert planner.bytes == {"extra": b"opaque bytes"}

    # The same items from a range that starts inside the file (offsets are relative to it).
    start = where[extra.storage_index].offset
    planner = Planner({"b": torch.zeros(4)})
    _loader(tmp_path, planner, where).load_range([extra, b], start, memoryview(data[start:]))
    assert torch.equal(planner.committed["b"], torch.ones(4)) and planner.bytes == {"extra": b"opaque bytes"}


def test_bytes_that_are_not_the_item_are_named(tmp_path: Path) -> None:
    w = _item("w")
    data, where = _file(tmp_path, {w: b"not a tensor archive at all"})
    loader = _loader(tmp_path, Planner({"w": torch.zeros(4)}), where)
    with pytest.raises(CorruptCheckpointError, match=r"data.distcp: item w at offset 0 cannot be decoded: ") as ei:
        loader.load(w, memoryview(data))
    assert str(tmp_path / "ckpt") in str(ei.value)


def test_a_tensor_of_another_shape_is_refused(tmp_path: Path) -> None:
    w = _item("w")
    data, where = _file(tmp_path, {w: _archive(torch.zeros(4))})
    planner = Planner({"w": torch.zeros(5)})
    with pytest.raises(
        CorruptCheckpointError, match=r"item w gives a tensor of shape \(4,\), the load plan expects \(5,\)"
    ):
        _loader(tmp_path, planner, where).load(w, memoryview(data))
    assert planner.committed == {}


def test_archive_crc_is_checked_only_when_asked(tmp_path: Path) -> None:
    w = _item("w", shape=(64,))
    good = _archive(torch.arange(64.0))
    bad = bytearray(good)
    payload = bytes(torch.arange(64.0).numpy().tobytes())
    at = good.index(payload) + 10
    bad[at] ^= 0xFF  # one byte of the stored tensor data: torch.load does not notice
    data, where = _file(tmp_path, {w: bytes(bad)})

    planner = Planner({"w": torch.zeros(64)})
    _loader(tmp_path, planner, where).load(w, memoryview(data))  # loads the damaged values
    assert not torch.equal(planner.committed["w"], torch.arange(64.0))
    planner = Planner({"w": torch.zeros(64)})
    with pytest.raises(CorruptCheckpointError, match=r"fails its archive's CRC-32 \(member .*\): the file was damaged"):
        _loader(tmp_path, planner, where, check_archive_crc=True).load(w, memoryview(data))
    assert planner.committed == {}


def test_zip_crc_problem() -> None:
    good = _archive(torch.arange(8.0))
    assert zip_crc_problem(memoryview(good)) is None
    bad = bytearray(good)
    bad[good.index(torch.arange(8.0).numpy().tobytes()) + 3] ^= 1
    assert (zip_crc_problem(memoryview(bytes(bad))) or "").startswith("member ")
    assert (zip_crc_problem(memoryview(b"no zip here")) or "").startswith("BadZipFile: ")


def test_memory_reader_reads_like_bytesio() -> None:
    payload = bytes(range(256)) * 40
    ours, ref = MemoryReader(memoryview(payload)), io.BytesIO(payload)
    for whence, offset, n in [
        (io.SEEK_SET, 5, 10),
        (io.SEEK_CUR, 100, 1000),
        (io.SEEK_END, -7, 50),
        (io.SEEK_SET, 0, 0),
    ]:
        assert ours.seek(offset, whence) == ref.seek(offset, whence)
        assert ours.read(n) == ref.read(n) and ours.tell() == ref.tell()
    assert ours.seek(-5, io.SEEK_SET) == 0  # clamped to the start
    archive = _archive(torch.ones(2))
    with zipfile.ZipFile(MemoryReader(memoryview(archive))) as z:  # type: ignore[arg-type]  # usable as a file
        assert z.testzip() is None and z.namelist()
