"""``.metadata`` pickled by a Python that writes enum members by name.

Python 3.11's first releases (3.11.2, Debian 12's system Python) pickle an enum member as
``getattr(EnumClass, "NAME")``; later ones pickle it by value. DCP's ``.metadata`` holds an enum
(``TensorProperties`` pickles its memory format as ``_MEM_FORMAT_ENCODING``), so a checkpoint written
there names ``builtins.getattr``. Both decoders (the restricted unpickler and the torch-free peek)
accept exactly that form and refuse every other use of ``getattr``. The by-name pickles are made
here with a pickler that reduces enum members as that Python does, since this interpreter does not.
"""

from __future__ import annotations

import enum
import hashlib
import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import metadata as old_sharded_metadata
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tests.unit.test_metadata_peek import WHERE, assert_agree, assert_same_refusal, rich_state_dict
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp import metadata_io
from uc_checkpoint.dcp.metadata_io import load_metadata
from uc_checkpoint.errors import UnsafeMetadataError
from uc_checkpoint.format.metadata_peek import ENUM_MEMBERS, peek_metadata


class _ByNamePickler(pickle.Pickler):
    """Pickles enum members as ``getattr(cls, name)``, as Python 3.11.0-3.11.2's ``Enum`` does."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def by_name_payload(obj: Any, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    buf = io.BytesIO()
    _ByNamePickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def signed(payload: bytes) -> bytes:
    """``payload`` with our checksum trailer, as UCVolumeWriter writes ``.metadata``."""
    return payload + metadata_io.TRAILER_PREFIX + hashlib.sha256(payload).hexdigest().encode() + b"\n"


def memory_formats(meta: Metadata) -> dict[str, torch.memory_format]:
    return {
        fqn: md.properties.memory_format
        for fqn, md in meta.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def test_the_table_of_enum_members_is_torchs() -> None:
    for (module, name), members in ENUM_MEMBERS.items():
        cls = {dcp_metadata.__name__: dcp_metadata, old_sharded_metadata.__name__: old_sharded_metadata}[module]
        assert set(vars(cls)[name].__members__) == members, (module, name)
        assert (module, name) in metadata_io.ALLOWED_GLOBALS


@pytest.mark.parametrize("protocol", [pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_a_by_name_metadata_decodes_as_the_by_value_one(
    writer: str, protocol: int, tmp_path: Path, staging: Path
) -> None:
    dest = tmp_path / "ckpt"
    make = UCVolumeWriter if writer == "ours" else FileSystemWriter
    dcp.save(rich_state_dict(), storage_writer=make(dest), no_dist=True)
    original = load_metadata((dest / ".metadata").read_bytes(), "m")
    # DCP records tensors as contiguous; one of each member makes every name travel.
    tensors = [md for md in original.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)]
    tensors[0].properties.memory_format = torch.channels_last
    tensors[1].properties.memory_format = torch.preserve_format
    payload = by_name_payload(original, protocol)
    assert b"getattr" in payload and b"_MEM_FORMAT_ENCODING" in payload
    for data in (signed(payload), payload) if writer == "stock" else (signed(payload),):
        peeked = assert_agree(data)
        decoded = load_metadata(data, WHERE)
        assert memory_formats(decoded) == memory_formats(original)
        assert {torch.channels_last, torch.preserve_format, torch.contiguous_format} == set(
            memory_formats(decoded).values()
        )
        assert peeked.referenced


def test_protocol_2_spells_getattr_as_python_2_did(tmp_path: Path, staging: Path) -> None:
    """Protocol 2 names ``__builtin__.getattr``; a stock checkpoint's metadata pickled so loads.
    (Protocols 0 and 1 rebuild objects through ``copy_reg``, refused by value and by name alike.)"""
    protocol = 2
    dest = tmp_path / "ckpt"
    dcp.save(rich_state_dict(), storage_writer=FileSystemWriter(dest), no_dist=True)
    original = load_metadata((dest / ".metadata").read_bytes(), "m")
    payload = by_name_payload(original, protocol)
    assert b"__builtin__" in payload
    assert_agree(payload)
    assert memory_formats(load_metadata(payload, WHERE)) == memory_formats(original)
    refused = by_name_payload(_Lookup(Metadata, "__init__"), protocol)
    assert "refusing to unpickle builtins.getattr" in str(assert_same_refusal(refused))


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_a_checkpoint_whose_metadata_names_enums_by_name_loads(writer: str, tmp_path: Path, staging: Path) -> None:
    """The whole path: a real checkpoint's ``.metadata`` rewritten in the by-name form, then
    ``dcp.load`` through UCVolumeReader gives back every tensor; stock FileSystemReader agrees."""
    dest = tmp_path / "ckpt"
    sd = rich_state_dict()
    make = UCVolumeWriter if writer == "ours" else FileSystemWriter
    dcp.save(sd, storage_writer=make(dest), no_dist=True)
    original = load_metadata((dest / ".metadata").read_bytes(), "m")
    payload = by_name_payload(original)
    (dest / ".metadata").write_bytes(signed(payload) if writer == "ours" else payload)
    shutil.copytree(dest, tmp_path / "copy")
    for reader in (UCVolumeReader(dest), FileSystemReader(tmp_path / "copy")):
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in rich_state_dict().items()}
        target["nested"] = {"a": {"b": torch.zeros(2), "s": None, "l": None}}
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert torch.equal(target["channels_last"], sd["channels_last"])
        assert torch.equal(target["w0"], sd["w0"])
        assert target["nested"]["a"]["s"] == "x"


class _Lookup:
    """Pickles as ``getattr(*args)``: the forms of ``getattr`` a ``.metadata`` must never use."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> Any:
        return getattr, self.args


_ENUM = dcp_metadata._MEM_FORMAT_ENCODING
REFUSED = {
    "not-a-member": (_ENUM, "_missing_"),
    "dunder-of-enum": (_ENUM, "__class__"),
    "member-attr": (_ENUM, "TORCH_CONTIGUOUS_FORMAT.__class__"),
    "default-arg": (_ENUM, "TORCH_CHANNELS_LAST", None),
    "one-arg": (_ENUM,),
    "no-arg": (),
    "int-name": (_ENUM, 1),
    "allowed-dataclass": (Metadata, "__init__"),
    "torch-size": (torch.Size, "__reduce_ex__"),
    "dtype": (torch.float32, "to"),
    "getattr-itself": (getattr, "__self__"),
    "plain-value": ("abc", "upper"),
}


@pytest.mark.parametrize("where", ["top", "planner_data"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_getattr_aimed_at_anything_else_is_refused(case: str, where: str, tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(rich_state_dict(), storage_writer=UCVolumeWriter(dest), no_dist=True)
    meta = load_metadata((dest / ".metadata").read_bytes(), "m")
    lookup = _Lookup(*REFUSED[case])
    if where == "planner_data":
        meta.planner_data = lookup
    payload = by_name_payload(lookup if where == "top" else meta)
    err = assert_same_refusal(signed(payload))
    assert isinstance(err, UnsafeMetadataError)
    assert f"refusing to unpickle builtins.getattr from {WHERE}" in str(err)


def test_a_by_name_lookup_cannot_be_given_state() -> None:
    """BUILD on the stand-in for ``getattr`` (to give the lookup attributes) fails in both."""
    payload = b"\x80\x04\x8c\x08builtins\x94\x8c\x07getattr\x94\x93}\x8c\x01xK\x01sb."
    for decode in (lambda d: load_metadata(d, WHERE), lambda d: peek_metadata(d, WHERE)):
        with pytest.raises(Exception) as info:
            decode(signed(payload))
        assert WHERE in str(info.value)
    assert getattr.__name__ == "getattr" and not hasattr(getattr, "x")
