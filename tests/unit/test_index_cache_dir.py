"""The data readers' default index directory (``<staging root>/uc-checkpoint-data-index-<uid>``)
is used only while it is this user's alone: an index is not secret (its checksum is a plain
SHA-256), so whoever can write there could hand a reader one that skips samples."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from uc_checkpoint.data.readers.base import IndexCache
from uc_checkpoint.volumes.memory import MemoryVolume

PAYLOAD = b"[0, 10, 20]"


def default_dir(staging: Path) -> Path:
    return staging / f"uc-checkpoint-data-index-{os.geteuid()}"


def round_trip(volume: MemoryVolume) -> bytes | None:
    cache = IndexCache()
    cache.store(volume, "a.jsonl", "kind", "v1", PAYLOAD)
    return IndexCache().load(volume, "a.jsonl", "kind", "v1")


def test_the_default_directory_is_made_private_and_used(staging: Path) -> None:
    volume = MemoryVolume("data")
    assert round_trip(volume) == PAYLOAD
    root = default_dir(staging)
    assert root.stat().st_mode & 0o777 == 0o700
    assert len(list(root.iterdir())) == 1


@pytest.mark.parametrize("damage", ["others-write", "symlink", "foreign"])
def test_a_directory_others_can_write_is_not_used(
    damage: str, staging: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = default_dir(staging)
    if damage == "others-write":
        root.mkdir(mode=0o777)
        root.chmod(0o777)
        why = "others can write to it (mode 0777)"
    elif damage == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
        why = "not a plain directory"
    else:
        if os.geteuid() != 0:
            pytest.skip("making a directory another user's needs root")
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        why = "belongs to uid 65534"
    volume = MemoryVolume("data")
    with caplog.at_level(logging.WARNING, logger="uc_checkpoint.data.readers.base"):
        assert round_trip(volume) is None  # nothing kept, nothing read: rebuilt at every start
    assert not [p for p in (tmp_path / "elsewhere", root) if p.is_dir() and any(p.iterdir())]
    assert any(why in r.getMessage() and "index_dir=" in r.getMessage() for r in caplog.records), caplog.text


def test_an_index_dir_given_is_the_users_choice(tmp_path: Path) -> None:
    shared = tmp_path / "team-indexes"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    cache = IndexCache(shared)
    volume = MemoryVolume("data")
    cache.store(volume, "a.jsonl", "kind", "v1", PAYLOAD)
    assert cache.load(volume, "a.jsonl", "kind", "v1") == PAYLOAD
