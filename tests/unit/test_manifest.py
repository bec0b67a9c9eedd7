"""The typed manifest (uc_checkpoint.format.manifest): it reads every format this release reads, it
refuses what is not a manifest, and the dict it builds is the one pickled into ``.metadata`` before
it existed, byte for byte."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from uc_checkpoint.dcp.metadata_io import load_metadata, manifest_of
from uc_checkpoint.dcp.writer import UCVolumeWriter
from uc_checkpoint.format import layout
from uc_checkpoint.format.integrity import FileRecord
from uc_checkpoint.format.manifest import (
    MANIFEST_FORMAT,
    Manifest,
    ManifestEntry,
    entries_of,
    is_readable,
    needs_trailer,
)

RECORDS = [
    FileRecord("__0_ab_0.distcp", 10, "0badf00d", 4, b"\x00\x00\x00\x01" * 3),
    FileRecord("__1_ab_0.distcp", 0, "00000000", 4, b""),
]
SAVED_BY = {"host": "h", "pid": 7, "time": 1.5}


def old_build_manifest(save_id: str, records: list[FileRecord], saved_by: dict | None) -> dict:
    """What layout.build_manifest returned before the typed manifest (copied from that release)."""
    manifest = {
        "format": 3,
        "save_id": save_id,
        "checksum": "crc32",
        "files": {
            r.name: {"size": r.size, "crc32": r.crc32, "block_size": r.block_size, "blocks": r.block_crc32}
            for r in records
        },
    }
    if saved_by is not None:
        manifest["saved_by"] = dict(saved_by)
    return manifest


def shape(value: object) -> object:
    """``value`` with every dict as a list of (key, shape) pairs in order, and every leaf typed."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    return (type(value).__name__, value)


@pytest.mark.parametrize("saved_by", [SAVED_BY, None])
def test_the_built_dict_pickles_to_the_same_bytes_as_before(saved_by) -> None:
    built = Manifest.build("sid", RECORDS, saved_by).to_dict()
    old = old_build_manifest("sid", RECORDS, saved_by)
    assert pickle.dumps(built, protocol=pickle.HIGHEST_PROTOCOL) == pickle.dumps(old, protocol=pickle.HIGHEST_PROTOCOL)
    assert layout.build_manifest("sid", RECORDS, saved_by) == old
    assert list(built) == list(old)  # key order is part of the pickled bytes


def test_round_trip_and_records() -> None:
    manifest = Manifest.build("sid", RECORDS, SAVED_BY)
    again = Manifest.from_dict(manifest.to_dict())
    assert again == manifest
    assert again.format == MANIFEST_FORMAT and again.needs_trailer
    assert again.records() == {r.name: r for r in RECORDS}
    assert layout.manifest_records(manifest.to_dict()) == {r.name: r for r in RECORDS}
    assert ManifestEntry.from_record(RECORDS[0]).to_record() == RECORDS[0]


@pytest.mark.parametrize("fmt", [1, 2])
def test_older_formats_still_read_and_write_back_unchanged(fmt: int) -> None:
    entry = {"size": 5, "crc32": "12345678"}
    if fmt == 2:
        entry |= {"block_size": 4, "blocks": b"\x00\x00\x00\x02\x00\x00\x00\x03"}
    raw = {"format": fmt, "save_id": "old", "checksum": "crc32", "files": {"__0_0.distcp": entry}}
    manifest = Manifest.from_dict(raw)
    assert manifest.format == fmt and not manifest.needs_trailer
    record = manifest.records()["__0_0.distcp"]
    assert (record.size, record.crc32) == (5, "12345678")
    assert record.block_size == (4 if fmt == 2 else 0)
    assert manifest.to_dict() == raw
    assert is_readable(raw) and not needs_trailer(raw)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ({"format": 99, "save_id": "s", "files": {}}, ValueError),
        ({"save_id": "s", "files": {}}, ValueError),
        ({"format": 3, "save_id": "s", "files": ["__0_0.distcp"]}, TypeError),
        ({"format": 3, "save_id": "s", "files": {"f": {"crc32": "00000000"}}}, KeyError),
        ({"format": 3, "save_id": "s", "files": {"f": {"size": "big", "crc32": "00000000"}}}, ValueError),
        ({"format": 3, "save_id": "s", "files": {"f": 5}}, TypeError),
        ({"format": 3, "save_id": 5, "files": {}}, TypeError),
        (["format", 3], TypeError),
    ],
)
def test_bad_manifests_are_refused(raw, error) -> None:
    with pytest.raises(error):
        Manifest.from_dict(raw)


def test_unreadable_formats_count_as_no_manifest() -> None:
    assert not is_readable({"format": 4}) and not is_readable("x") and not is_readable(None)
    assert needs_trailer({"format": 3}) and not needs_trailer({"format": 2})
    assert entries_of(None) == {} and entries_of({"format": 3}) == {}


def test_a_saved_checkpoint_manifest_is_the_typed_dict(tmp_path: Path, staging: Path) -> None:
    sd = {"w": torch.arange(1000, dtype=torch.float32), "b": {"x": 1}}
    dcp.save(sd, storage_writer=UCVolumeWriter(tmp_path / "ck"), no_dist=True)
    metadata = load_metadata((tmp_path / "ck" / ".metadata").read_bytes(), "m")
    raw = manifest_of(metadata)
    assert raw is not None and raw["files"]
    typed = Manifest.from_dict(raw)
    # Same keys in the same order, same values of the same types (the pickled bytes of an unpickled
    # dict differ from a fresh one's only in which equal strings are one object).
    assert shape(typed.to_dict()) == shape(raw)
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "ck").glob("*.distcp")}
    assert {name: e.size for name, e in typed.files.items()} == sizes
