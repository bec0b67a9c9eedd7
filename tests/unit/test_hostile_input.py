"""Damaged and hostile checkpoints: each is refused with an error that names the file, before any
wrong tensor reaches the caller, and ``.metadata`` never runs code it names."""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import random
import shlex
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from tests.conftest import assert_state_dict_equal, cause, empty_like_state_dict, make_state_dict
from uc_checkpoint import CorruptCheckpointError, UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.metadata_io import (
    ALLOWED_GLOBALS,
    bad_file_name,
    dump_metadata,
    is_allowed_global,
    load_metadata,
)
from uc_checkpoint.dcp.options import ReaderOptions, WriterOptions
from uc_checkpoint.errors import UnsafeMetadataError

warnings.filterwarnings("ignore", category=UserWarning)

HINT = "allow_unsafe_metadata=True"


# ---- helpers -------------------------------------------------------------------------------------


def load_error(dest: Path, sd: dict, **kwargs: Any) -> BaseException:
    """Load ``dest`` into a zeroed template, expect failure, check the template was not written
    (nothing is read after a refusal) and return the inner error."""
    template = empty_like_state_dict(sd)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(template, storage_reader=UCVolumeReader(dest, options=ReaderOptions(**kwargs)))
    assert_untouched(template)
    return cause(ei)


def assert_untouched(template: dict) -> None:
    for key, value in template.items():
        if isinstance(value, torch.Tensor):
            assert not value.any(), f"{key} was written by a refused load"


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".distcp"))


def read_meta(dest: Path, name: str = ".metadata") -> Metadata:
    return load_metadata((dest / name).read_bytes(), str(dest / name))


def write_meta(dest: Path, meta: Any, name: str = ".metadata") -> Path:
    """Rewrite ``.metadata`` as a hostile editor who also recomputes its checksum trailer would, so
    that the checks behind the checksum are what is tested."""
    path = dest / name
    path.write_bytes(dump_metadata(meta))
    return path


def global_pickle(module: str, name: str, opcode: str = "STACK_GLOBAL", call: bool = True) -> bytes:
    """A pickle that names ``module.name`` (and calls it with no arguments when ``call``)."""
    if opcode == "GLOBAL":  # protocol 0 text opcode
        body = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
        head = b""
    else:  # protocol 4: two strings, then STACK_GLOBAL
        body = b"".join(b"\x8c" + bytes([len(s)]) + s.encode() for s in (module, name)) + b"\x93"
        head = b"\x80\x04"
    return head + body + (b")R" if call else b"") + b"."


class SystemCall:
    """Pickles as ``os.system(command)``: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (os.system, (self.command,))


class EvalCall:
    """Pickles as ``builtins.eval(source)``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (eval, (self.source,))


class CounterCall:
    """Pickles as ``collections.Counter({"a": 2})``: harmless, but not part of DCP's format."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (collections.Counter, ({"a": 2},))


def touch_payload(kind: str, marker: Path) -> Any:
    if kind == "os.system":
        return SystemCall(f"touch {shlex.quote(str(marker))}")
    return EvalCall(f"__import__('pathlib').Path({str(marker)!r}).touch()")


def refused_name(kind: str) -> str:
    return f"{os.system.__module__}.system" if kind == "os.system" else "builtins.eval"


def place(meta: Metadata, where: str, payload: Any) -> Any:
    """Put ``payload`` into ``meta`` at ``where``; return the object to pickle."""
    if where == "top":
        return payload
    if where == "storage_data":
        meta.storage_data[next(iter(meta.storage_data))] = payload
    elif where == "state_dict_metadata":
        meta.state_dict_metadata["w0"] = payload
    elif where == "planner_data":
        meta.planner_data = payload
    elif where == "manifest":
        meta.uc_manifest["save_id"] = payload  # type: ignore[attr-defined]
    return meta


@pytest.fixture
def saved(tmp_path: Path, staging: Path) -> tuple[Path, dict]:
    """A small checkpoint written by UCVolumeWriter, split into several data files."""
    sd = make_state_dict(21, n=3, rows=64)
    dest = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=20_000)))
    assert len(data_files(dest)) >= 3
    return dest, sd


# ---- code in .metadata ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["os.system", "eval"])
def test_hostile_payloads_are_real_exploits(tmp_path: Path, kind: str) -> None:
    """Guards the tests below: plain pickle.loads of these payloads does run them."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(touch_payload(kind, marker)))
    assert marker.exists()


@pytest.mark.parametrize("where", ["top", "storage_data", "state_dict_metadata", "planner_data", "manifest"])
@pytest.mark.parametrize("kind", ["os.system", "eval"])
def test_metadata_that_runs_code_is_refused(saved: tuple[Path, dict], tmp_path: Path, kind: str, where: str) -> None:
    dest, sd = saved
    marker = tmp_path / "pwned"
    meta_path = write_meta(dest, place(read_meta(dest), where, touch_payload(kind, marker)))
    err = load_error(dest, sd)
    assert isinstance(err, UnsafeMetadataError) and isinstance(err, CorruptCheckpointError)
    msg = str(err)
    assert str(meta_path) in msg and f"refusing to unpickle {refused_name(kind)}" in msg and HINT in msg
    assert not marker.exists(), "the payload ran"


def test_rank_local_metadata_is_restricted_too(saved: tuple[Path, dict], tmp_path: Path) -> None:
    dest, _ = saved
    marker = tmp_path / "pwned"
    hostile = place(read_meta(dest), "storage_data", touch_payload("os.system", marker))
    meta_path = write_meta(dest, hostile, "__0.metadata")
    with pytest.raises(UnsafeMetadataError) as ei:
        UCVolumeReader(dest).load_metadata(rank=0)
    assert str(meta_path) in str(ei.value)
    assert not marker.exists()


def test_allow_unsafe_metadata_opts_in(saved: tuple[Path, dict]) -> None:
    dest, sd = saved
    meta = read_meta(dest)
    meta.extra = CounterCall()  # type: ignore[attr-defined]
    meta_path = write_meta(dest, meta)

    err = load_error(dest, sd)
    assert isinstance(err, UnsafeMetadataError)
    assert "collections.Counter" in str(err) and str(meta_path) in str(err)

    # The opt-in really unpickles the foreign global, and the checkpoint still loads correctly.
    loaded = UCVolumeReader(dest, options=ReaderOptions(allow_unsafe_metadata=True)).load_metadata()
    assert loaded.extra == collections.Counter({"a": 2})  # type: ignore[attr-defined]
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=UCVolumeReader(dest, options=ReaderOptions(allow_unsafe_metadata=True)))
    assert_state_dict_equal(out, sd)


def test_reader_keeps_the_opt_in_when_pickled(tmp_path: Path) -> None:
    for flag in (False, True):
        clone = pickle.loads(
            pickle.dumps(UCVolumeReader(tmp_path / "a", options=ReaderOptions(allow_unsafe_metadata=flag)))
        )
        assert clone.options.allow_unsafe_metadata is flag


# ---- paths that leave the checkpoint -------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    # "ABS" stands for an absolute path to a decoy file (tmp_path is not known here).
    [
        "../x.distcp",
        "/etc/passwd",
        "ABS",
        "s3://other/x",
        "sub/x.distcp",
        "..\\x.distcp",
        "",
        "..",
        "x\0.distcp",
        "C:x.distcp",
    ],
)
def test_data_file_outside_the_checkpoint_is_refused(saved: tuple[Path, dict], tmp_path: Path, bad: str) -> None:
    dest, sd = saved
    meta = read_meta(dest)
    victim = next(iter(meta.storage_data.values())).relative_path
    if bad == "ABS":
        bad = str(tmp_path / "elsewhere.distcp")
    # Decoys: a valid copy of the data file where the bad name points, so a reader that followed
    # the name would load "successfully" and this test would fail.
    for decoy in (dest.parent / "x.distcp", dest / "sub" / "x.distcp", tmp_path / "elsewhere.distcp"):
        decoy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(dest / victim, decoy)
    meta.storage_data = {
        idx: dataclasses.replace(info, relative_path=bad) if info.relative_path == victim else info
        for idx, info in meta.storage_data.items()
    }
    meta_path = write_meta(dest, meta)
    err = load_error(dest, sd)
    assert isinstance(err, CorruptCheckpointError) and not isinstance(err, UnsafeMetadataError)
    assert str(meta_path) in str(err) and repr(bad) in str(err) and "outside the checkpoint" in str(err)


@pytest.mark.parametrize("bad", ["../evil.distcp", "/tmp/evil.distcp", "s3://other/evil.distcp"])
def test_manifest_entry_outside_the_checkpoint_is_refused(saved: tuple[Path, dict], bad: str) -> None:
    dest, sd = saved
    meta = read_meta(dest)
    files = meta.uc_manifest["files"]  # type: ignore[attr-defined]
    files[bad] = dict(next(iter(files.values())))
    meta_path = write_meta(dest, meta)
    err = load_error(dest, sd)
    assert isinstance(err, CorruptCheckpointError)
    assert str(meta_path) in str(err) and repr(bad) in str(err) and "manifest entry" in str(err)


def test_malformed_manifest_is_refused(saved: tuple[Path, dict]) -> None:
    dest, sd = saved
    meta = read_meta(dest)
    files = meta.uc_manifest["files"]  # type: ignore[attr-defined]
    files[next(iter(files))]["size"] = "big"
    meta_path = write_meta(dest, meta)
    err = load_error(dest, sd)
    assert isinstance(err, CorruptCheckpointError)
    assert str(meta_path) in str(err) and "manifest is malformed" in str(err)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("__0_0.distcp", True),
        ("__12_ab12cd34_7.distcp", True),
        ("model-00001-of-00002.safetensors", True),
        ("../x", False),
        ("/abs", False),
        ("a/b", False),
        ("a\\b", False),
        ("s3://b/k", False),
        ("C:x", False),
        ("", False),
        (".", False),
        ("..", False),
        ("a\0b", False),
        (None, False),
        (b"x.distcp", False),
    ],
)
def test_bad_file_name(name: object, ok: bool) -> None:
    assert (bad_file_name(name) is None) is ok


@pytest.mark.parametrize("damage", ["not a mapping", "not a _StorageInfo", "negative offset", "str length"])
def test_malformed_storage_data_is_refused(saved: tuple[Path, dict], damage: str) -> None:
    dest, _ = saved
    meta = read_meta(dest)
    first = next(iter(meta.storage_data))
    if damage == "not a mapping":
        meta.storage_data = list(meta.storage_data.values())
    elif damage == "not a _StorageInfo":
        meta.storage_data[first] = ("__0_0.distcp", 0, 10)
    elif damage == "negative offset":
        meta.storage_data[first] = dataclasses.replace(meta.storage_data[first], offset=-1)
    else:
        meta.storage_data[first] = dataclasses.replace(meta.storage_data[first], length="10")
    with pytest.raises(CorruptCheckpointError) as ei:
        load_metadata(dump_metadata(meta), "WHERE/.metadata")
    assert "WHERE/.metadata" in str(ei.value)


# ---- broken .metadata ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: random.Random(0).randbytes(4096), id="random"),
        pytest.param(lambda b: b[:-1], id="no-stop"),
        pytest.param(lambda b: pickle.dumps({"state_dict_metadata": {}}), id="not-metadata"),
    ],
)
def test_broken_metadata(saved: tuple[Path, dict], damage: Callable[[bytes], bytes]) -> None:
    dest, sd = saved
    meta_path = dest / ".metadata"
    meta_path.write_bytes(damage(meta_path.read_bytes()))
    err = load_error(dest, sd)
    assert isinstance(err, CorruptCheckpointError) and str(meta_path) in str(err)


# ---- broken data files ---------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch_files", [True, False], ids=["whole-files", "ranges"])
def test_flipped_byte_in_data_file(saved: tuple[Path, dict], prefetch_files: bool) -> None:
    dest, sd = saved
    victim = dest / data_files(dest)[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as ei:
        dcp.load(
            empty_like_state_dict(sd),
            storage_reader=UCVolumeReader(dest, options=ReaderOptions(prefetch_files=prefetch_files)),
        )
    err = cause(ei)
    assert isinstance(err, CorruptCheckpointError) and str(victim) in str(err) and "checksum" in str(err)


@pytest.mark.parametrize("prefetch_files", [True, False], ids=["whole-files", "ranges"])
def test_missing_data_file(saved: tuple[Path, dict], prefetch_files: bool) -> None:
    dest, sd = saved
    victim = dest / data_files(dest)[-1]
    victim.unlink()
    with pytest.raises(CheckpointException) as ei:
        dcp.load(
            empty_like_state_dict(sd),
            storage_reader=UCVolumeReader(dest, options=ReaderOptions(prefetch_files=prefetch_files)),
        )
    err = cause(ei)
    assert isinstance(err, CorruptCheckpointError) and str(victim) in str(err) and "missing" in str(err)


# ---- the restricted loader itself ----------------------------------------------------------------


class RecordingUnpickler(pickle.Unpickler):
    """Plain unpickling that records every global the pickle names."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add((module, name))
        return super().find_class(module, name)


@pytest.mark.parametrize("writer", ["uc", "stock"])
def test_real_checkpoints_load_unchanged(tmp_path: Path, staging: Path, writer: str) -> None:
    """Every global real checkpoints name is allowed, and the restricted loader returns what
    pickle.loads does (tensors of many dtypes, channels-last, requires_grad, 0-d, plain objects)."""
    sd: dict[str, Any] = make_state_dict(3, n=1, rows=8)
    for dtype in (
        torch.float16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
    ):
        sd[f"t_{dtype}".replace("torch.", "")] = torch.ones(3).to(dtype)
    sd["channels_last"] = torch.randn(1, 2, 3, 3).to(memory_format=torch.channels_last)
    sd["grad"] = torch.randn(2, requires_grad=True)
    sd["zero_d"] = torch.tensor(1.5)
    sd["empty"] = torch.empty(0, 4)
    sd["nested"] = {"a": {"b": torch.ones(2), "s": "x", "l": [1, 2.5, None]}}
    dest = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=UCVolumeWriter(dest) if writer == "uc" else FileSystemWriter(dest))

    data = (dest / ".metadata").read_bytes()
    recorder = RecordingUnpickler(data)
    expected = recorder.load()
    refused = sorted(g for g in recorder.seen if not is_allowed_global(*g))
    assert refused == [], f"a real {writer} checkpoint names globals outside the allow-list"
    got = load_metadata(data, str(dest / ".metadata"))
    assert got == expected
    assert getattr(got, "uc_manifest", None) == getattr(expected, "uc_manifest", None)
    if writer == "uc":
        assert got.uc_manifest["files"]  # type: ignore[attr-defined]

    template = zeroed(sd)
    dcp.load(template, storage_reader=UCVolumeReader(dest))
    assert_same(template, sd)


def zeroed(value: Any) -> Any:
    """A load template: zeroed tensors, blank plain objects, same nesting."""
    if isinstance(value, dict):
        return {k: zeroed(v) for k, v in value.items()}
    return torch.zeros_like(value.detach()) if isinstance(value, torch.Tensor) else None


def assert_same(got: Any, want: Any, key: str = "") -> None:
    """Equal structure and values; tensors compared byte for byte (float8 has no torch.equal)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), key
        for k in want:
            assert_same(got[k], want[k], f"{key}.{k}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got.detach().flatten().view(torch.uint8), want.detach().flatten().view(torch.uint8)), key
    else:
        assert got == want, key


@pytest.mark.parametrize("opcode", ["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("posix", "system"),
        ("os", "system"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("builtins", "__import__"),
        ("__builtin__", "eval"),  # Python 2 name: must not be remapped to builtins.eval and then allowed
        ("subprocess", "Popen"),
        ("pickle", "loads"),
        ("torch", "load"),
        ("torch", "float32.__class__"),  # a dotted path through an allowed object
        ("torch.serialization", "load"),
        ("torch.distributed.checkpoint.metadata", "torch"),  # a module reached through an allowed module
        ("collections", "Counter"),
    ],
)
def test_loader_refuses_foreign_globals(tmp_path: Path, module: str, name: str, opcode: str) -> None:
    where = str(tmp_path / ".metadata")
    with pytest.raises(UnsafeMetadataError) as ei:
        load_metadata(global_pickle(module, name, opcode), where)
    msg = str(ei.value)
    assert f"refusing to unpickle {module}.{name} from {where}" in msg and HINT in msg


def test_loader_resolves_allowed_globals_but_wants_metadata() -> None:
    """An allowed global is resolved (no UnsafeMetadataError), yet a file that is not Metadata is
    still refused."""
    for module, name in sorted(ALLOWED_GLOBALS) + [("torch", "bfloat16")]:
        if module == "pathlib._local" and sys.version_info < (3, 13):
            continue  # Python 3.13 moved the pathlib classes there
        with pytest.raises(CorruptCheckpointError) as ei:
            load_metadata(global_pickle(module, name, call=False), "W/.metadata")
        assert not isinstance(ei.value, UnsafeMetadataError), (module, name)
        assert "W/.metadata does not hold DCP Metadata" in str(ei.value)


def test_allow_list_rules() -> None:
    dtypes = [n for n, v in vars(torch).items() if isinstance(v, torch.dtype)]
    assert {"float32", "bfloat16", "int64", "bool", "float8_e4m3fn"} <= set(dtypes)
    assert all(is_allowed_global("torch", n) for n in dtypes)
    assert is_allowed_global("torch", "Size")
    assert not is_allowed_global("torch", "Tensor")
    assert not is_allowed_global("torch", "tensor")
    assert not is_allowed_global("torch", "float32.__class__")
    assert not is_allowed_global("torch.serialization", "_get_layout.__globals__")


def test_loader_undoes_changes_to_allowed_classes() -> None:
    """Pickle's BUILD can set attributes on a class it was handed; the loader refuses such a file
    and puts the class back, so nothing leaks into the rest of the process."""
    original_hash = MetadataIndex.__hash__
    head = global_pickle("torch.distributed.checkpoint.metadata", "MetadataIndex", call=False)[:-1]
    # (None, {"__hash__": None, "hacked": 1}) as BUILD state: the second item is set with setattr.
    payload = head + b"N}(\x8c\x08__hash__N\x8c\x06hackedK\x01u\x86b."
    with pytest.raises(UnsafeMetadataError) as ei:
        load_metadata(payload, "W/.metadata")
    assert "MetadataIndex.__hash__" in str(ei.value) and "MetadataIndex.hacked" in str(ei.value)
    assert MetadataIndex.__hash__ is original_hash
    assert not hasattr(MetadataIndex, "hacked")
    assert hash(MetadataIndex("a")) == hash(MetadataIndex("a"))


def test_loader_opt_in_is_plain_pickle() -> None:
    data = pickle.dumps(Metadata(state_dict_metadata={}, planner_data=CounterCall()))
    with pytest.raises(UnsafeMetadataError):
        load_metadata(data, "W/.metadata")
    assert load_metadata(data, "W/.metadata", allow_unsafe=True).planner_data == collections.Counter({"a": 2})


def test_loader_checks_paths_even_when_unsafe_is_allowed() -> None:
    meta = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo("../x.distcp", 0, 1)})
    with pytest.raises(CorruptCheckpointError) as ei:
        load_metadata(pickle.dumps(meta), "W/.metadata", allow_unsafe=True)
    assert "'../x.distcp'" in str(ei.value) and "W/.metadata" in str(ei.value)
