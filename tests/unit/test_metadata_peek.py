"""The torch-free peek at a ``.metadata`` (uc_checkpoint.format.metadata_peek): on every real
checkpoint kind it gives what the full decoder (uc_checkpoint.dcp.metadata_io) gives, it refuses
every hostile or damaged input the full decoder refuses (the inputs of test_hostile_input.py and
test_metadata_integrity.py), with the same error class and message, and it never imports torch or
runs what a pickle names."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from tests.conftest import make_state_dict
from tests.support.stream_extensions import EXTENSION_CASES
from tests.unit.test_hostile_input import CounterCall, global_pickle, place, refused_name, touch_payload
from uc_checkpoint import UCVolumeWriter
from uc_checkpoint.dcp import metadata_io
from uc_checkpoint.dcp.metadata_io import data_file_names, dump_metadata, load_metadata, manifest_of, referenced_files
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.errors import CorruptCheckpointError, UnsafeMetadataError
from uc_checkpoint.format import metadata_peek
from uc_checkpoint.format.metadata_peek import TORCH_DTYPE_NAMES, PeekedMetadata, peek_metadata
from uc_checkpoint.ops.catalog import inspect_step, list_steps, scan
from uc_checkpoint.volumes import LocalVolume

WHERE = "W/.metadata"


def assert_agree(data: bytes, where: str = WHERE) -> PeekedMetadata:
    """The peek of ``data`` says what the full decoder's results say."""
    full = load_metadata(data, where)
    peeked = peek_metadata(data, where)
    assert peeked.referenced == referenced_files(full)
    assert peeked.manifest == manifest_of(full)
    assert peeked.file_names() == data_file_names(full)
    assert peeked.save_id == (manifest_of(full) or {}).get("save_id")
    return peeked


def refusals(data: bytes, where: str = WHERE) -> tuple[CorruptCheckpointError, CorruptCheckpointError]:
    """``(full decoder's error, peek's error)`` for ``data``, which both must refuse."""
    with pytest.raises(CorruptCheckpointError) as full:
        load_metadata(data, where)
    with pytest.raises(CorruptCheckpointError) as peeked:
        peek_metadata(data, where)
    return full.value, peeked.value


def resign(payload: bytes) -> bytes:
    """``payload`` with a checksum trailer, as a hostile editor who recomputes it would write it."""
    return payload + metadata_io.TRAILER_PREFIX + hashlib.sha256(payload).hexdigest().encode() + b"\n"


def assert_same_refusal(data: bytes, where: str = WHERE) -> CorruptCheckpointError:
    full, peeked = refusals(data, where)
    assert type(peeked) is type(full), (full, peeked)
    assert str(peeked) == str(full)
    return peeked


# ---- real checkpoints ----------------------------------------------------------------------------


def rich_state_dict() -> dict[str, Any]:
    """What test_hostile_input's real checkpoints hold: many dtypes, channels-last, requires_grad,
    0-d and empty tensors, nested plain objects."""
    sd: dict[str, Any] = make_state_dict(3, n=2, rows=8)
    for dtype in (torch.float16, torch.float64, torch.int8, torch.bool, torch.complex64, torch.float8_e4m3fn):
        sd[f"t_{dtype}".replace("torch.", "")] = torch.ones(3).to(dtype)
    sd["channels_last"] = torch.randn(1, 2, 3, 3).to(memory_format=torch.channels_last)
    sd["grad"] = torch.randn(2, requires_grad=True)
    sd["zero_d"] = torch.tensor(1.5)
    sd["empty"] = torch.empty(0, 4)
    sd["nested"] = {"a": {"b": torch.ones(2), "s": "x", "l": [1, 2.5, None]}}
    return sd


WRITERS: dict[str, Callable[[Path], Any]] = {
    "ours": lambda dest: UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=4_000)),
    "ours-spread": lambda dest: UCVolumeWriter(dest, options=WriterOptions(spread_prefixes=16)),
    "ours-zstd": lambda dest: UCVolumeWriter(dest, _extensions=EXTENSION_CASES["zstd"]()),
    "ours-rot13": lambda dest: UCVolumeWriter(dest, _extensions=EXTENSION_CASES["rot13"]()),
    "stock": lambda dest: FileSystemWriter(dest),
    "stock-str-path": lambda dest: FileSystemWriter(str(dest)),
    "stock-zstd": lambda dest: FileSystemWriter(dest, _extensions=EXTENSION_CASES["zstd"]()),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_the_peek_agrees_with_the_decoder_on_real_checkpoints(writer: str, tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(rich_state_dict(), storage_writer=WRITERS[writer](dest), no_dist=True)
    peeked = assert_agree((dest / ".metadata").read_bytes(), str(dest / ".metadata"))
    assert peeked.referenced and all((dest / name).stat().st_size >= n for name, n in peeked.referenced.items())
    if writer.startswith("ours"):
        assert (
            peeked.manifest is not None and peeked.save_id and set(peeked.manifest["files"]) == set(peeked.referenced)
        )
    else:
        assert peeked.manifest is None and peeked.save_id is None
    if writer == "ours-spread":
        assert all("/" in name for name in peeked.referenced)


def test_the_peek_agrees_on_older_manifest_formats_and_odd_shapes(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(make_state_dict(1, n=1, rows=4), storage_writer=UCVolumeWriter(dest), no_dist=True)
    meta = load_metadata((dest / ".metadata").read_bytes(), "m")
    for fmt in (1, 2):  # written without a trailer
        old = dataclasses.replace(meta)
        old.uc_manifest = {**meta.uc_manifest, "format": fmt}  # type: ignore[attr-defined]
        assert assert_agree(pickle.dumps(old)).manifest is not None
    future = dataclasses.replace(meta)
    future.uc_manifest = {**meta.uc_manifest, "format": 99}  # type: ignore[attr-defined]
    assert assert_agree(dump_metadata(future)).manifest is None  # a format this release does not read
    # No storage data at all; older pickle protocols; a Metadata built by a call, as a hand-made
    # pickle might (pickle.loads runs its __init__ with the arguments).
    assert assert_agree(pickle.dumps(Metadata(state_dict_metadata={}))).referenced == {}
    assert_agree(resign(pickle.dumps(meta, protocol=4)))
    # Protocols before 4 pickle bytes and dataclasses through functions neither reader resolves.
    assert "copy_reg._reconstructor" in str(assert_same_refusal(pickle.dumps(meta, protocol=0)))
    assert "_codecs.encode" in str(assert_same_refusal(pickle.dumps(meta, protocol=2)))

    class Called:
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return (Metadata, ({}, None, {MetadataIndex("w"): _StorageInfo("__0_0.distcp", 5, 7)}))

    assert assert_agree(pickle.dumps(Called())).referenced == {"__0_0.distcp": 12}


# ---- hostile and damaged .metadata ---------------------------------------------------------------


@pytest.fixture
def meta(tmp_path: Path, staging: Path) -> Metadata:
    """The decoded ``.metadata`` of a small checkpoint of several data files, written by UCVolumeWriter."""
    dest = tmp_path / "ckpt"
    dcp.save(
        make_state_dict(21, n=3, rows=64),
        storage_writer=UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=20_000)),
    )
    return load_metadata((dest / ".metadata").read_bytes(), "m")


@pytest.mark.parametrize("where", ["top", "storage_data", "state_dict_metadata", "planner_data", "manifest"])
@pytest.mark.parametrize("kind", ["os.system", "eval"])
def test_code_in_metadata_is_refused_and_never_runs(meta: Metadata, tmp_path: Path, kind: str, where: str) -> None:
    marker = tmp_path / "pwned"
    data = dump_metadata(place(meta, where, touch_payload(kind, marker)))
    err = assert_same_refusal(data)
    assert isinstance(err, UnsafeMetadataError) and f"refusing to unpickle {refused_name(kind)}" in str(err)
    assert not marker.exists(), "the payload ran"


def test_a_harmless_foreign_global_is_refused_too(meta: Metadata) -> None:
    meta.extra = CounterCall()  # type: ignore[attr-defined]
    assert "collections.Counter" in str(assert_same_refusal(dump_metadata(meta)))


@pytest.mark.parametrize("opcode", ["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("posix", "system"),
        ("os", "system"),
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("builtins", "__import__"),
        ("__builtin__", "eval"),
        ("subprocess", "Popen"),
        ("pickle", "loads"),
        ("torch", "load"),
        ("torch", "Tensor"),
        ("torch", "float32.__class__"),
        ("torch.serialization", "load"),
        ("torch.distributed.checkpoint.metadata", "torch"),
        ("collections", "Counter"),
        ("uc_checkpoint.format.metadata_peek", "_StandIn"),
    ],
)
def test_foreign_globals_are_refused(module: str, name: str, opcode: str) -> None:
    err = assert_same_refusal(global_pickle(module, name, opcode))
    assert isinstance(err, UnsafeMetadataError) and f"refusing to unpickle {module}.{name} from {WHERE}" in str(err)


def test_allowed_globals_resolve_but_are_not_metadata() -> None:
    for module, name in sorted(metadata_io.ALLOWED_GLOBALS - {metadata_peek.METADATA_GLOBAL}):
        if module == "pathlib._local" and sys.version_info < (3, 13):
            continue  # Python 3.13 moved the pathlib classes there
        for call in (False, True):
            if call and (module, name) != ("torch", "Size"):
                continue  # calling the real classes without arguments fails in other ways
            _full, peeked = refusals(global_pickle(module, name, call=call))
            assert not isinstance(peeked, UnsafeMetadataError), (module, name)
            assert f"{WHERE} does not hold DCP Metadata" in str(peeked)
    _full, peeked = refusals(global_pickle("torch", "bfloat16", call=False))
    assert f"{WHERE} does not hold DCP Metadata" in str(peeked)


def test_setting_attributes_of_a_global_is_refused() -> None:
    head = global_pickle("torch.distributed.checkpoint.metadata", "MetadataIndex", call=False)[:-1]
    payload = head + b"N}(\x8c\x08__hash__N\x8c\x06hackedK\x01u\x86b."  # BUILD (None, {...}) on the class
    full, peeked = refusals(payload)
    assert isinstance(full, UnsafeMetadataError) and isinstance(peeked, UnsafeMetadataError)
    assert "MetadataIndex.__hash__" in str(peeked) and "MetadataIndex.hacked" in str(peeked) and WHERE in str(peeked)


@pytest.mark.parametrize(
    "bad", ["../x.distcp", "/etc/passwd", "s3://other/x", "sub/x.distcp", "..\\x.distcp", "", "..", "x\0.distcp", "C:x"]
)
def test_data_files_outside_the_checkpoint_are_refused(meta: Metadata, bad: str) -> None:
    victim = next(iter(meta.storage_data.values())).relative_path
    meta.storage_data = {
        idx: dataclasses.replace(info, relative_path=bad) if info.relative_path == victim else info
        for idx, info in meta.storage_data.items()
    }
    err = assert_same_refusal(dump_metadata(meta))
    assert repr(bad) in str(err) and "outside the checkpoint" in str(err)


@pytest.mark.parametrize("bad", ["../evil.distcp", "/tmp/evil.distcp", "s3://other/evil.distcp"])
def test_manifest_entries_outside_the_checkpoint_are_refused(meta: Metadata, bad: str) -> None:
    files = meta.uc_manifest["files"]  # type: ignore[attr-defined]
    files[bad] = dict(next(iter(files.values())))
    assert "manifest entry" in str(assert_same_refusal(dump_metadata(meta)))


@pytest.mark.parametrize("damage", ["size", "files", "record"])
def test_malformed_manifests_are_refused(meta: Metadata, damage: str) -> None:
    files = meta.uc_manifest["files"]  # type: ignore[attr-defined]
    if damage == "size":
        files[next(iter(files))]["size"] = "big"
    elif damage == "files":
        meta.uc_manifest["files"] = [1, 2]  # type: ignore[attr-defined]
    else:
        files[next(iter(files))] = 7
    assert_same_refusal(dump_metadata(meta))


@pytest.mark.parametrize(
    "damage",
    ["not a mapping", "not a _StorageInfo", "negative offset", "str length", "descriptors", "no path", "odd state"],
)
def test_malformed_storage_data_is_refused(meta: Metadata, damage: str) -> None:
    first = next(iter(meta.storage_data))
    info = meta.storage_data[first]
    if damage == "not a mapping":
        meta.storage_data = list(meta.storage_data.values())
    elif damage == "not a _StorageInfo":
        meta.storage_data[first] = ("__0_0.distcp", 0, 10)
    elif damage == "negative offset":
        meta.storage_data[first] = dataclasses.replace(info, offset=-1)
    elif damage == "str length":
        meta.storage_data[first] = dataclasses.replace(info, length="10")
    elif damage == "descriptors":
        meta.storage_data[first] = dataclasses.replace(info, transform_descriptors="stream.zstd/1")
    elif damage == "no path":
        del info.__dict__["relative_path"]
    else:
        info.__dict__.clear()  # its state pickles as {}: replaced below by one no class without __setstate__ takes
    data = dump_metadata(meta)
    if damage == "odd state":
        payload = metadata_peek.split_trailer(data)[0]
        assert payload.count(b"}\x94b") == 1  # the emptied entry's BUILD: made an empty tuple
        data = resign(payload.replace(b"}\x94b", b")\x94b"))
    assert_same_refusal(data)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: random.Random(0).randbytes(4096), id="random"),
        pytest.param(lambda b: b[:-1], id="no-stop"),
        pytest.param(lambda b: metadata_peek.split_trailer(b)[0], id="lost-trailer"),
        pytest.param(lambda b: metadata_peek.split_trailer(b)[0][:-1], id="lost-trailer-and-stop"),
        pytest.param(lambda b: b"\x00" + b[1:], id="checksum"),
        # The trailer's last digit changed (to 1 where it was 0: the damage must change something).
        pytest.param(lambda b: b[:-2] + (b"1" if b[-2:-1] == b"0" else b"0") + b[-1:], id="trailer-digit"),
        pytest.param(lambda b: pickle.dumps({"state_dict_metadata": {}}), id="not-metadata"),
        pytest.param(lambda b: b"\x80\x04K\x01Q.", id="persistent-id"),
        pytest.param(lambda b: b"\x80\x04\x82\x01.", id="extension-code"),
    ],
)
def test_broken_metadata_is_refused(meta: Metadata, damage: Callable[[bytes], bytes]) -> None:
    assert_same_refusal(damage(dump_metadata(meta)))


def test_every_flipped_byte_of_a_trailed_metadata_is_refused_or_harmless(meta: Metadata) -> None:
    """A flipped byte anywhere in a ``.metadata`` with a trailer: the checksum, the trailer's own
    digits, a lost trailer (format 3 requires one) or a pickle that no longer loads."""
    data = dump_metadata(meta)
    rng = random.Random(1)
    for pos in sorted(rng.sample(range(len(data)), 120)) + [len(data) - 1, len(data) - 40]:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << rng.randrange(8)
        try:
            full = load_metadata(bytes(flipped), WHERE)
        except CorruptCheckpointError:
            assert_same_refusal(bytes(flipped))
        else:
            assert_agree(bytes(flipped))
            assert referenced_files(full) == referenced_files(meta)


# ---- the stand-ins -------------------------------------------------------------------------------


def test_stand_ins_are_inert_and_made_per_load() -> None:
    unpickler = metadata_peek._InertUnpickler(b".", WHERE)
    cls = unpickler.find_class(*metadata_peek.METADATA_GLOBAL)
    assert cls is unpickler.find_class(*metadata_peek.METADATA_GLOBAL)
    assert cls is not metadata_peek._InertUnpickler(b".", WHERE).find_class(*metadata_peek.METADATA_GLOBAL)
    assert (cls.__module__, cls.__name__) == metadata_peek.METADATA_GLOBAL
    index = unpickler.find_class("torch.distributed.checkpoint.metadata", "MetadataIndex")
    one, two = index(1, 2, k=3), index.__new__(index, "x")
    assert one != two and len({one, two}) == 2 and not callable(one) and not hasattr(one, "__dict__")
    with pytest.raises(TypeError):
        one["k"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        one.anything = 1  # type: ignore[attr-defined]
    with pytest.raises(UnsafeMetadataError, match=r"Metadata\.x"):
        cls.__setstate__({"x": 1})  # what BUILD on the class itself does
    assert unpickler.find_class("torch", "float32").__name__ == "float32"


def test_the_dtype_names_are_torchs() -> None:
    assert {n for n, v in vars(torch).items() if isinstance(v, torch.dtype)} == set(TORCH_DTYPE_NAMES)
    assert metadata_io.ALLOWED_GLOBALS is metadata_peek.ALLOWED_GLOBALS


def test_the_peek_imports_no_torch(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(make_state_dict(2, n=1, rows=4), storage_writer=UCVolumeWriter(dest), no_dist=True)
    hostile = tmp_path / "hostile.metadata"
    hostile.write_bytes(global_pickle("os", "system"))
    probe = (
        "import sys\n"
        "from uc_checkpoint.format.metadata_peek import peek_metadata\n"
        "from uc_checkpoint.errors import UnsafeMetadataError\n"
        "print(sorted(peek_metadata(open(sys.argv[1], 'rb').read(), 'a').referenced))\n"
        "try:\n"
        "    peek_metadata(open(sys.argv[2], 'rb').read(), 'b')\n"
        "except UnsafeMetadataError:\n"
        "    print('refused')\n"
        "print('torch modules:', sum(m.split('.')[0] == 'torch' for m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(dest / ".metadata"), str(hostile)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused" in proc.stdout and proc.stdout.strip().endswith("torch modules: 0"), proc.stdout


# ---- the catalog: ls peeks, latest() decodes -----------------------------------------------------


def test_listing_and_decoding_give_the_same_states(meta: Metadata, tmp_path: Path, staging: Path) -> None:
    """Each damaged .metadata is judged alike by ``inspect_step`` with the peek (``ls``) and with the
    full decoder (``latest()``): same state, same problem."""
    root = LocalVolume(tmp_path / "root")
    good = make_state_dict(5, n=1, rows=4)
    cases: dict[str, Callable[[Path], None]] = {
        "intact": lambda d: None,
        "missing file": lambda d: next(d.glob("*.distcp")).unlink(),
        "short file": lambda d: next(d.glob("*.distcp")).write_bytes(b"x"),
        "garbage": lambda d: (d / ".metadata").write_bytes(b"not a pickle"),
        "os.system": lambda d: (d / ".metadata").write_bytes(global_pickle("os", "system")),
        "checksum": lambda d: (d / ".metadata").write_bytes(b"x" + (d / ".metadata").read_bytes()[1:]),
        "path": lambda d: (d / ".metadata").write_bytes(
            dump_metadata(Metadata({}, storage_data={MetadataIndex("w"): _StorageInfo("../x.distcp", 0, 1)}))
        ),
    }
    for step, damage in enumerate(cases.values()):
        dest = tmp_path / "root" / f"step_{step:08d}"
        dcp.save(good, storage_writer=UCVolumeWriter(dest), no_dist=True)
        damage(dest)
    now = time.time()
    for info in list_steps(root):
        peeked = inspect_step(root, info, details=True, peek=True, now=now)
        decoded = inspect_step(root, info, details=True, now=now)
        assert peeked == decoded
    states = [(i.state, (i.problem or "")[:40]) for i in scan(root, check="all")]
    assert [s for s, _ in states] == ["complete", "broken", "broken", "broken", "broken", "broken", "broken"], states
