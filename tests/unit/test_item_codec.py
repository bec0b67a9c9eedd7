"""ItemCodec: DCP's per-tensor torch.save archives, written and read through templates.

The point of every test: whatever the fast path writes, stock ``torch.load`` (and so DCP's stock
FileSystemReader) reads back bit for bit; whatever the fast path decodes is exactly what
``torch.load`` would return; anything it does not recognise is left to torch."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.item_codec import MAX_FAST_BYTES, ItemCodec
from uc_checkpoint.dcp.options import ReaderOptions
from uc_checkpoint.errors import CorruptCheckpointError, ItemChecksumError, rank_error

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (NaN-safe equality)."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(1, 9), min_size=0, max_size=3), seed=st.integers(0, 2**16)
)
def test_written_items_are_torch_save_archives_and_decode_exactly(
    dtype: torch.dtype, shape: list[int], seed: int
) -> None:
    codec = ItemCodec()
    t = _random(dtype, tuple(shape), seed)
    buf = io.BytesIO()
    codec.write(t, buf)
    assert codec.fast_encoded == 1
    raw = buf.getvalue()

    back = torch.load(io.BytesIO(raw), weights_only=True)  # what DCP's FileSystemReader does
    assert back.dtype == dtype and back.shape == t.shape and _bits(back) == _bits(t)

    decoded = codec.decode(memoryview(bytearray(raw)), dtype, tuple(shape))
    assert decoded is not None and decoded.dtype == dtype and decoded.shape == t.shape and _bits(decoded) == _bits(t)

    # Archives written by torch.save itself (stock DCP writers) take the fast path as well.
    stock = io.BytesIO()
    torch.save(t, stock)
    decoded = codec.decode(stock.getvalue(), dtype, tuple(shape))
    assert decoded is not None and _bits(decoded) == _bits(t)


def test_views_are_written_as_their_values() -> None:
    codec = ItemCodec()
    base = torch.arange(64.0).reshape(8, 8)
    for view in (base.t(), base[2:5], base[:, 3]):  # non-contiguous, offset into storage
        buf = io.BytesIO()
        codec.write(view, buf)
        assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), view)
    assert codec.fast_encoded == 3


def test_what_the_fast_path_leaves_to_torch() -> None:
    codec = ItemCodec()
    big = torch.randn(MAX_FAST_BYTES // 4 + 1)
    for t in (big, torch.randn(4, dtype=torch.complex64), torch.empty(0, 3), torch.nn.Parameter(torch.ones(3))):
        buf = io.BytesIO()
        codec.write(t, buf)
        back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        assert torch.equal(back, t.detach())
    assert codec.fast_encoded == 1  # only the Parameter (written as a plain tensor)

    t = torch.randn(16, 4)
    buf = io.BytesIO()
    codec.write(t, buf)
    good = buf.getvalue()
    assert codec.decode(good, torch.float32, (16, 4)) is not None
    # Asked for another dtype or shape, given a damaged or truncated archive, or a Parameter's
    # archive (a different data.pkl): not decoded, so torch.load decides.
    assert codec.decode(good, torch.int32, (16, 4)) is None
    assert codec.decode(good, torch.float32, (4, 16)) is None
    assert codec.decode(good[:-1], torch.float32, (16, 4)) is None
    flipped = bytearray(good)
    start = good.index(_bits(t)[:64])
    flipped[start + 10] ^= 0x01
    # torch.load itself does not check a record's CRC-32; the codec does.
    with pytest.raises(ItemChecksumError, match="crc32"):
        codec.decode(flipped, torch.float32, (16, 4))
    param = io.BytesIO()
    torch.save(torch.nn.Parameter(t.clone()), param)
    assert codec.decode(param.getvalue(), torch.float32, (16, 4)) is None


def _many_small(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(32, 8, generator=g) for i in range(300)}
        | {f"b{i}": torch.randn(8, generator=g).to(torch.bfloat16) for i in range(50)}
        | {"big": torch.randn(600, 1024, generator=g)},  # 2.3 MiB: torch.save path
        "step": 5,
    }


def _zeros_like(sd: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}


@pytest.mark.parametrize("prefetch_files", [True, False])
def test_checkpoints_of_small_tensors_round_trip_with_stock_dcp(
    tmp_path: Path, staging: Path, prefetch_files: bool, caplog: pytest.LogCaptureFixture
) -> None:
    sd = _many_small(0)
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    with caplog.at_level(logging.DEBUG, logger="uc_checkpoint"):
        dcp.save(sd, storage_writer=UCVolumeWriter(ours))
    assert "350 of 351 tensor items serialised through templates" in caplog.text
    dcp.save(sd, storage_writer=FileSystemWriter(stock))

    out = _zeros_like(sd)
    dcp.load(out, storage_reader=FileSystemReader(ours))  # stock DCP reads what we wrote
    for k, v in sd["model"].items():
        assert torch.equal(out["model"][k], v), k

    for where in (ours, stock):  # we read what we wrote and what stock DCP wrote
        out = _zeros_like(sd)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="uc_checkpoint"):
            dcp.load(out, storage_reader=UCVolumeReader(where, options=ReaderOptions(prefetch_files=prefetch_files)))
        # With a manifest (ours) the big tensor is copied straight into place too; without one its
        # archive CRC must be checked, which torch.load's path does.
        expected = "351 of 351" if where == ours else "350 of 351"
        assert f"{expected} tensor items decoded through templates" in caplog.text, where
        assert out["step"] == 5
        for k, v in sd["model"].items():
            assert torch.equal(out["model"][k], v), (where, k)


@pytest.mark.parametrize("prefetch_files", [True, False])
def test_a_damaged_small_tensor_in_a_stock_checkpoint_is_named(
    tmp_path: Path, staging: Path, prefetch_files: bool
) -> None:
    """A checkpoint from stock FileSystemWriter has no manifest, so no file checksums; a flipped
    byte in a small tensor's data is still caught by the archive's own CRC-32 (torch.load is not)."""
    sd = _many_small(1)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    victim = sd["model"]["w7"]
    data_file = next(tmp_path.glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    at = raw.index(_bits(victim)[:64]) + 40
    raw[at] ^= 0x10
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            _zeros_like(sd),
            storage_reader=UCVolumeReader(tmp_path, options=ReaderOptions(prefetch_files=prefetch_files)),
        )
    error = rank_error(info.value)
    assert isinstance(error, CorruptCheckpointError), error
    assert data_file.name in str(error) and "model.w7" in str(error) and "crc32" in str(error)


def test_large_items_skip_the_zip_crc_and_damage_is_still_caught(tmp_path: Path, staging: Path) -> None:
    """Tensors above the template size are written by torch's own zip writer without its per-record
    CRC-32 (torch.load never checks it); they load with stock DCP, and a flipped byte in one is
    caught by the manifest's block CRC-32s instead."""
    import zipfile

    big = torch.randn(MAX_FAST_BYTES // 4 * 3)
    buf = io.BytesIO()
    ItemCodec().write(big, buf)
    reference = io.BytesIO()
    torch.save(big, reference)
    assert len(buf.getvalue()) == len(reference.getvalue())  # the same archive but for the CRC fields
    assert {info.CRC for info in zipfile.ZipFile(io.BytesIO(buf.getvalue())).infolist()} == {0}
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), big)

    sd = {"big": big, "small": torch.randn(8)}
    where = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(where))
    out = {"big": torch.zeros_like(big), "small": torch.zeros(8)}
    dcp.load(out, storage_reader=FileSystemReader(where))
    assert torch.equal(out["big"], big) and torch.equal(out["small"], sd["small"])

    # The small tensor has a file of its own: damage the one that holds the big one.
    (data_file,) = [p for p in where.glob("*.distcp") if _bits(big)[:64] in p.read_bytes()]
    raw = bytearray(data_file.read_bytes())
    raw[raw.index(_bits(big)[:64]) + 4096] ^= 0x01
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"big": torch.zeros_like(big)}, storage_reader=UCVolumeReader(where))
    error = rank_error(info.value)
    assert isinstance(error, CorruptCheckpointError), error
    assert data_file.name in str(error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_large_items_are_copied_straight_into_the_target(dtype: torch.dtype) -> None:
    """Archives by our writer (no zip CRCs) and by torch.save (CRCs) alike: the tensor bytes go
    straight into the target; anything that is not that exact archive leaves the target untouched."""
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(600, 257, generator=g) * 100).to(dtype)
    if dtype == torch.bool:
        t = torch.randint(0, 2, (1024, 300), generator=g).bool()
    assert t.numel() * t.element_size() > MAX_FAST_BYTES
    codec = ItemCodec()
    ours, stock = io.BytesIO(), io.BytesIO()
    codec.write(t, ours)
    torch.save(t, stock)
    # Read-only bytes (a whole file read) and writable memory (a load's range buffers) alike.
    for archive in (ours.getvalue(), stock.getvalue(), memoryview(bytearray(ours.getvalue()))):
        target = torch.zeros_like(t)
        assert codec.decode_into(archive, target)
        assert _bits(target) == _bits(t)
    assert codec.fast_decoded == 3

    archive = ours.getvalue()
    untouched = torch.zeros_like(t)
    for target in (
        torch.zeros(t.shape[::-1], dtype=dtype),  # another shape
        torch.zeros(t.shape, dtype=torch.float64),  # another dtype
        torch.zeros(t.shape[0], t.shape[1] + 1, dtype=dtype)[:, 1:],  # not contiguous
        torch.zeros(4, 4, dtype=dtype),  # small: decode() is the path for those
    ):
        assert not codec.decode_into(archive, target)
        assert not target.any()
    damaged = bytearray(archive)
    damaged[archive.index(b"data.pkl") + 60] ^= 0x01  # inside the pickled tensor description
    assert not codec.decode_into(bytes(damaged), untouched)
    assert not codec.decode_into(archive[:-1][: len(archive) // 2], untouched)  # cut short
    assert not untouched.any()


def test_templates_and_heads_are_built_once_per_process_and_hold_no_tensor_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job saves and loads the same shapes again and again: a new codec (one per save or load)
    must not run torch.save for a (dtype, shape) an earlier one built; what is kept is the archive
    around the tensor, not a tensor's worth of bytes."""
    from uc_checkpoint.dcp import item_codec

    small = torch.arange(MAX_FAST_BYTES // 4, dtype=torch.float32).reshape(64, -1) * 0.5
    large = torch.ones(1025, 256, dtype=torch.float32)  # above MAX_FAST_BYTES: the head path
    ItemCodec().write(small, io.BytesIO())
    archive = io.BytesIO()
    torch.save(large, archive)
    assert ItemCodec().decode_into(archive.getvalue(), torch.empty_like(large))
    saves: list[object] = []
    original = torch.save

    def counting(*args: object, **kwargs: object) -> None:
        saves.append(args[0])
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", counting)
    monkeypatch.setattr(item_codec, "save_without_zip_crc", lambda *_: saves.append("head"))
    codec = ItemCodec()
    out = io.BytesIO()
    codec.write(small, out)
    target = torch.empty_like(large)
    assert codec.decode_into(archive.getvalue(), target) and torch.equal(target, large)
    assert saves == [] and codec.fast_encoded == 1 and codec.fast_decoded == 1
    assert torch.equal(torch.load(io.BytesIO(out.getvalue()), weights_only=True), small)
    template = item_codec._template_for(torch.float32, (64, small.numel() // 64))
    assert template is not None and len(template.head) + len(template.tail) < 4096 < template.size


def test_archives_not_laid_out_as_one_stored_tensor_record_get_no_template() -> None:
    """The zip walk behind templates and heads finds the one storage record and its CRC-32 fields;
    an archive it cannot template is refused (then torch.save / torch.load do the work)."""
    import warnings
    import zipfile

    from uc_checkpoint.dcp import item_codec

    def storage(raw: bytes, nbytes: int = 16) -> item_codec._Record | None:
        records = item_codec._layout_of(raw)
        return None if records is None else item_codec._storage_record(records, nbytes)

    def archive(obj: object) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    good = archive(torch.arange(4.0))
    record = storage(good)
    assert record is not None and good[record.start : record.start + 16] == _bits(torch.arange(4.0))
    assert record.descriptor_crc is not None  # torch's writer puts the CRC-32 after the data
    for at in (record.central_crc, record.descriptor_crc):
        assert int.from_bytes(good[at : at + 4], "little") == zipfile.crc32(_bits(torch.arange(4.0)))

    def rewritten(method: int, duplicate: bool = False) -> bytes:
        src, out = zipfile.ZipFile(io.BytesIO(good)), io.BytesIO()
        with zipfile.ZipFile(out, "w", method) as z, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the duplicate name
            for info in src.infolist() + ([src.getinfo("archive/data/0")] if duplicate else []):
                z.writestr(info.filename, src.read(info))
        return out.getvalue()

    stored = rewritten(zipfile.ZIP_STORED)  # no data descriptors: the CRC-32 is in the local header
    record = storage(stored)
    assert record is not None and record.descriptor_crc is None
    assert stored[record.local_crc : record.local_crc + 4] == stored[record.central_crc : record.central_crc + 4]
    assert storage(good, 8) is None  # another size
    for refused in (
        archive((torch.zeros(4), torch.ones(4))),  # two storages
        rewritten(zipfile.ZIP_DEFLATED),  # compressed
        rewritten(zipfile.ZIP_STORED, duplicate=True),
        good[:-1],
        good[: len(good) // 2],
        b"not a zip archive" * 10,
        b"",
    ):
        assert storage(refused) is None
