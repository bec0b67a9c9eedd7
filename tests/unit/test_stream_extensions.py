"""DCP's stream extensions (ZStandard, user transforms) and the rest of what DCP's
``FileSystemWriter``/``FileSystemReader`` accept, on our writer and reader: the same on-volume
format both ways (local paths and ``memory://``; S3 in tests/functional/test_s3_extensions.py),
checksums over the stored bytes, resharded reads of transformed tensors, and a table of every
stock constructor argument."""

from __future__ import annotations

import inspect
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat

from tests.conftest import assert_state_dict_equal, cause, empty_like_state_dict, make_state_dict, staging_files
from tests.support.stream_extensions import (
    EXTENSION_CASES,
    FailingOnRead,
    Rot13Example,
    ZStandard,
    partial_read,
    registry,
)
from uc_checkpoint import CorruptCheckpointError, UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.buffers import StagingBuffers
from uc_checkpoint.dcp.options import ReaderOptions, WriterOptions
from uc_checkpoint.format import layout
from uc_checkpoint.volumes import FsspecVolume

CASES = sorted(EXTENSION_CASES)


def metadata_of(dest: Path) -> Any:
    return pickle.loads((dest / ".metadata").read_bytes())


def load_ours(location: Any, sd: dict, **kw: Any) -> dict:
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=UCVolumeReader(location, _extension_registry=registry(), options=ReaderOptions(**kw)))
    return out


# ---- the same format, both ways ------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_our_checkpoint_with_extensions_loads_in_stock_and_our_reader(case: str, tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(1)
    dest = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(dest, _extensions=EXTENSION_CASES[case]()))
    expected = [ex.get_descriptor() for ex in reversed(EXTENSION_CASES[case]())]
    infos = list(metadata_of(dest).storage_data.values())
    assert infos and all(info.transform_descriptors == expected for info in infos)

    stock = empty_like_state_dict(sd)
    dcp.load(stock, storage_reader=FileSystemReader(dest, _extension_registry=registry()))
    assert_state_dict_equal(stock, sd)
    for prefetch in (True, False):  # whole files, and ranged reads of each item's stored bytes
        assert_state_dict_equal(load_ours(dest, sd, prefetch_files=prefetch), sd)
    assert staging_files(staging) == []


@pytest.mark.parametrize("case", CASES)
def test_stock_checkpoint_with_extensions_loads_in_our_reader(case: str, tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(2)
    dest = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=FileSystemWriter(dest, _extensions=EXTENSION_CASES[case]()))
    for prefetch in (True, False):
        assert_state_dict_equal(load_ours(dest, sd, prefetch_files=prefetch), sd)


def test_zstd_needs_no_registry(tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(3)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock", _extensions=[ZStandard()]))
    dcp.save(sd, storage_writer=UCVolumeWriter(tmp_path / "ours", _extensions=[ZStandard()]))
    for dest in ("stock", "ours"):
        out = empty_like_state_dict(sd)
        dcp.load(out, storage_reader=UCVolumeReader(tmp_path / dest))  # DCP's default registry
        assert_state_dict_equal(out, sd)
        stock = empty_like_state_dict(sd)
        dcp.load(stock, storage_reader=FileSystemReader(tmp_path / dest))
        assert_state_dict_equal(stock, sd)


@pytest.mark.parametrize("case", ["zstd", "rot13"])
def test_memory_fsspec_volume_both_ways(case: str, tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(4)
    ours, stock = f"memory://uc-ext-{tmp_path.name}/ours", f"memory://uc-ext-{tmp_path.name}/stock"
    dcp.save(sd, storage_writer=UCVolumeWriter(FsspecVolume(ours), _extensions=EXTENSION_CASES[case]()))
    out = empty_like_state_dict(sd)
    stock_reader = FsspecReader(ours)  # its keyword arguments are fsspec's: the registry is set afterwards
    stock_reader.transforms.extension_registry = registry()
    dcp.load(out, storage_reader=stock_reader)
    assert_state_dict_equal(out, sd)

    dcp.save(sd, storage_writer=FsspecWriter(stock, sync_files=False, _extensions=EXTENSION_CASES[case]()))
    for prefetch in (None, True):  # ranged reads by default on fsspec
        assert_state_dict_equal(load_ours(FsspecVolume(stock), sd, prefetch_files=prefetch), sd)
    assert_state_dict_equal(load_ours(FsspecVolume(ours), sd), sd)


def test_async_save_and_pickling_keep_the_extensions(tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(5)
    writer = UCVolumeWriter(tmp_path / "ckpt", _extensions=[ZStandard()])
    copy = pickle.loads(pickle.dumps(writer))  # DCP's PROCESS mode pickles the writer
    assert [type(ex) for ex in copy.transforms.extensions] == [ZStandard]
    dcp.async_save(sd, storage_writer=writer).result(timeout=120)
    assert all(i.transform_descriptors for i in metadata_of(tmp_path / "ckpt").storage_data.values())
    assert_state_dict_equal(load_ours(tmp_path / "ckpt", sd), sd)


def test_a_chain_of_extensions_is_refused_as_dcp_cannot_read_it_back(tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(14)
    with pytest.raises(ValueError, match="one StreamTransformExtension"):
        UCVolumeWriter(tmp_path / "ours", _extensions=[Rot13Example(), ZStandard()])
    # Why: DCP undoes a chain in the order it was applied. When a torch reads its own chained
    # checkpoints back, this fails and the refusal can go.
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock", _extensions=[Rot13Example(), ZStandard()]))
    with pytest.raises(CheckpointException):
        dcp.load(
            empty_like_state_dict(sd),
            storage_reader=FileSystemReader(tmp_path / "stock", _extension_registry=registry()),
        )


def test_without_extensions_nothing_is_recorded(tmp_path: Path, staging: Path) -> None:
    dcp.save(make_state_dict(6), storage_writer=UCVolumeWriter(tmp_path / "ckpt"))
    infos = metadata_of(tmp_path / "ckpt").storage_data.values()
    assert all(
        info.transform_descriptors is None and "transform_descriptors" not in info.__getstate__() for info in infos
    )


# ---- what is stored and checked -------------------------------------------------------------------
def test_checksums_and_sizes_are_of_the_compressed_bytes_on_the_volume(tmp_path: Path, staging: Path) -> None:
    sd = {"zeros": torch.zeros(512, 1024), "ramp": torch.arange(300_000, dtype=torch.int64), "step": 7}
    dest = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(dest, _extensions=[ZStandard()]))
    meta = metadata_of(dest)
    records = layout.manifest_records(meta.uc_manifest)
    assert records
    for name, rec in records.items():
        raw = (dest / name).read_bytes()
        assert rec.size == len(raw)
        assert rec.crc32 == f"{zlib.crc32(raw):08x}"
        blocks = [raw[i : i + rec.block_size] for i in range(0, len(raw), rec.block_size)] if rec.block_size else []
        assert rec.block_crc32 == b"".join(zlib.crc32(b).to_bytes(4, "big") for b in blocks)
    zeros = next(info for index, info in meta.storage_data.items() if index.fqn == "zeros")
    assert zeros.length < 512 * 1024 * 4 // 50  # stored compressed
    out = {"zeros": torch.ones(512, 1024), "ramp": torch.zeros(300_000, dtype=torch.int64), "step": None}
    dcp.load(out, storage_reader=UCVolumeReader(dest, options=ReaderOptions(prefetch_files=False)))
    assert_state_dict_equal(out, sd)


@pytest.mark.parametrize("prefetch", [False, True], ids=["ranges", "whole-files"])
def test_a_damaged_compressed_file_fails_its_checksum(prefetch: bool, tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(7)
    dest = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(dest, _extensions=[ZStandard()]))
    name = max((p for p in dest.iterdir() if p.name.endswith(".distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(name.read_bytes())
    data[len(data) // 2] ^= 0x01
    name.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as ei:
        load_ours(dest, sd, prefetch_files=prefetch)
    assert isinstance(cause(ei), CorruptCheckpointError) and name.name in str(cause(ei))


def test_bytes_that_do_not_untransform_are_a_corrupt_checkpoint(tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(8)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "ckpt", _extensions=[FailingOnRead()]))
    with pytest.raises(CheckpointException) as ei:
        load_ours(tmp_path / "ckpt", sd)
    assert isinstance(cause(ei), CorruptCheckpointError) and "stream.test-failing/1" in str(cause(ei))


def test_an_unknown_extension_is_named_before_anything_is_fetched(tmp_path: Path, staging: Path) -> None:
    sd = make_state_dict(9)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "ckpt", _extensions=[Rot13Example()]))
    reader = UCVolumeReader(tmp_path / "ckpt")
    with pytest.raises(CheckpointException) as ei:
        dcp.load(empty_like_state_dict(sd), storage_reader=reader)
    err = cause(ei)
    assert isinstance(err, ValueError) and "stream.rot13" in str(err) and "_extension_registry" in str(err)
    assert reader.last_record is None  # failed before fetching


# ---- resharded reads of transformed tensors -------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prefetch", [False, True], ids=["ranges", "whole-files"])
def test_a_smaller_chunk_of_a_transformed_tensor_is_read_right(
    case: str, prefetch: bool, tmp_path: Path, staging: Path
) -> None:
    sd = make_state_dict(10)  # w3: 1024 x 64 float32, 256 KiB, one saved chunk
    dest = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(dest, _extensions=EXTENSION_CASES[case]()))
    ours = partial_read(
        UCVolumeReader(dest, _extension_registry=registry(), options=ReaderOptions(prefetch_files=prefetch)),
        "w3",
        (100, 357),
    )
    assert torch.equal(ours, sd["w3"][100:357])
    stock = partial_read(FileSystemReader(dest, _extension_registry=registry()), "w3", (100, 357))
    assert torch.equal(stock, ours)


# ---- every argument of DCP's FileSystemWriter / FileSystemReader ---------------------------------
def _files(dest: Path) -> set[str]:
    return {info.relative_path for info in metadata_of(dest).storage_data.values()}


def _same_files(tmp_path: Path, **kw: Any) -> None:
    sd = make_state_dict(11)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock", **kw))
    dcp.save(sd, storage_writer=UCVolumeWriter(tmp_path / "ours", **kw))
    assert len(_files(tmp_path / "ours")) == len(_files(tmp_path / "stock"))
    assert_state_dict_equal(load_ours(tmp_path / "ours", sd), sd)


def _round_trip(tmp_path: Path) -> None:
    sd = make_state_dict(13)
    for where in (tmp_path / "as-path", str(tmp_path / "as-str")):
        dcp.save(sd, storage_writer=UCVolumeWriter(where))
        assert_state_dict_equal(load_ours(where, sd), sd)


def _single_file_per_rank(tmp_path: Path) -> None:
    _same_files(tmp_path / "one", single_file_per_rank=True)
    _same_files(tmp_path / "two", single_file_per_rank=True, thread_count=2)
    _same_files(tmp_path / "per-item", single_file_per_rank=False)
    with pytest.raises(ValueError, match="file_size_bytes"):
        UCVolumeWriter(tmp_path, single_file_per_rank=True, options=WriterOptions(file_size_bytes=1 << 20))


def _cache_staged_state_dict(tmp_path: Path) -> None:
    assert isinstance(UCVolumeWriter(tmp_path, cache_staged_state_dict=True).staging_buffers, StagingBuffers)
    assert UCVolumeWriter(tmp_path, cache_staged_state_dict=False).staging_buffers is None
    with pytest.raises(ValueError, match="staging_buffers"):
        UCVolumeWriter(tmp_path, cache_staged_state_dict=True, staging_buffers=StagingBuffers())


def _serialization_format(tmp_path: Path) -> None:
    UCVolumeWriter(tmp_path, serialization_format=SerializationFormat.TORCH_SAVE)
    with pytest.raises(ValueError, match="TORCH_SAVE"):
        UCVolumeWriter(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)


def _attribute(name: str, value: Any) -> Callable[[Path], None]:
    """The argument is taken as stock takes it: it replaces the writer options' field of that name
    (where ours keeps every setting)."""

    def check(tmp_path: Path) -> None:
        writer = UCVolumeWriter(tmp_path, **{name: value})
        assert getattr(writer.options, name) == getattr(FileSystemWriter(tmp_path, **{name: value}), name) == value
        assert writer.options == UCVolumeWriter(tmp_path, options=WriterOptions(**{name: value})).options

    return check


def _extensions(tmp_path: Path) -> None:
    zstd = ZStandard()
    assert list(UCVolumeWriter(tmp_path, _extensions=[zstd]).transforms.extensions) == [zstd]
    with pytest.raises(TypeError, match="StreamTransformExtension"):
        UCVolumeWriter(tmp_path, _extensions=["zstd"])


#: What each argument of FileSystemWriter.__init__ does on UCVolumeWriter (a check per argument).
WRITER_ARGUMENTS: dict[str, Callable[[Path], None]] = {
    "path": lambda tmp_path: _round_trip(tmp_path),
    "single_file_per_rank": _single_file_per_rank,
    "sync_files": _attribute("sync_files", False),
    "thread_count": _attribute("thread_count", 3),
    "per_thread_copy_ahead": _attribute("per_thread_copy_ahead", 1 << 20),
    "cache_staged_state_dict": _cache_staged_state_dict,
    "overwrite": _attribute("overwrite", False),
    "_extensions": _extensions,
    "serialization_format": _serialization_format,
}


def _registry(tmp_path: Path) -> None:
    sd = make_state_dict(12)
    dcp.save(sd, storage_writer=UCVolumeWriter(tmp_path / "ckpt", _extensions=[Rot13Example()]))
    assert_state_dict_equal(load_ours(tmp_path / "ckpt", sd), sd)
    with pytest.raises(TypeError, match="ExtensionRegistry"):
        UCVolumeReader(tmp_path, _extension_registry=[Rot13Example])


READER_ARGUMENTS: dict[str, Callable[[Path], None]] = {
    "path": lambda tmp_path: UCVolumeReader(tmp_path),
    "_extension_registry": _registry,
}


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    return {
        name: p
        for name, p in params.items()
        if name != "self" and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }


@pytest.mark.parametrize(
    ("stock", "table"), [(FileSystemWriter, WRITER_ARGUMENTS), (FileSystemReader, READER_ARGUMENTS)]
)
def test_every_stock_argument_is_in_the_table(stock: type, table: dict) -> None:
    # A torch that adds an argument fails here until it is given a meaning (or a refusal) and a check.
    assert set(_parameters(stock)) == set(table)


@pytest.mark.parametrize(("stock", "ours"), [(FileSystemWriter, UCVolumeWriter), (FileSystemReader, UCVolumeReader)])
def test_every_stock_argument_is_taken_with_its_default(stock: type, ours: type, tmp_path: Path) -> None:
    defaults = {n: p.default for n, p in _parameters(stock).items() if p.default is not inspect.Parameter.empty}
    assert set(defaults) <= set(inspect.signature(ours).parameters)
    ours(tmp_path, **defaults)


@pytest.mark.parametrize("name", sorted(WRITER_ARGUMENTS))
def test_writer_argument(name: str, tmp_path: Path, staging: Path) -> None:
    WRITER_ARGUMENTS[name](tmp_path)


@pytest.mark.parametrize("name", sorted(READER_ARGUMENTS))
def test_reader_argument(name: str, tmp_path: Path, staging: Path) -> None:
    READER_ARGUMENTS[name](tmp_path)
