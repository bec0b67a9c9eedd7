"""Listing caches never hide another process's checkpoint.

s3fs and gcsfs answer ``ls``/``info``/``size`` from a listing cache with no expiry, and fsspec shares
one filesystem instance per protocol and options. The filesystems of tests/support/caching_fs.py cache the
same way over real local files; they come in two kinds, one whose ``ls``/``info`` take
``refresh=True`` and one that takes no such keyword (only ``invalidate_cache`` refreshes it). Each
test first shows that the plain cached call is stale, so it would fail if FsspecVolume trusted it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, SCRIPTS
from tests.support import caching_fs  # noqa: F401 - registers the protocols
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.summary import list_root
from uc_checkpoint.ops.verify import verify_checkpoint
from uc_checkpoint.volumes import FsspecVolume

PROTOCOLS = ["uccache", "uccachenr"]


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "meta": {"step": step}}


def blank() -> dict:
    return {"w": torch.zeros(64, 32), "meta": {"step": -1}}


def cached_names(volume: FsspecVolume) -> set[str]:
    """What the filesystem's own (cached) ``ls`` says is at the volume's root."""
    return {name.rsplit("/", 1)[-1] for name in volume.fs.ls(volume.root, detail=False)}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_volume_sees_files_changed_behind_its_cache(tmp_path: Path, protocol: str) -> None:
    loc = tmp_path / "loc"
    loc.mkdir()
    (loc / "a").write_bytes(b"1")
    volume = FsspecVolume(f"{protocol}://{loc}", tag="unit")
    assert volume.size("a") == 1 and volume.size("b") is None
    assert volume.list_files() == {"a": 1}  # the filesystem keeps this listing
    # Another process adds b, rewrites a longer, creates a sub-location.
    (loc / "b").write_bytes(b"22")
    (loc / "a").write_bytes(b"55555")
    (loc / "sub").mkdir()
    assert cached_names(volume) == {"a"}  # the filesystem's own answer is stale
    with pytest.raises(FileNotFoundError):
        volume.fs.info(f"{volume.root}/b")  # and it denies b exists, as s3fs does
    assert volume.size("b") == 2 and volume.size("a") == 5
    assert volume.list_files() == {"a": 5, "b": 2, "sub/": -1}
    (loc / "c").write_bytes(b"333")
    assert cached_names(volume) == {"a", "b", "sub"}  # stale again
    assert volume.list_files() == {"a": 5, "b": 2, "c": 3, "sub/": -1}
    (loc / "d").write_bytes(b"4444")
    assert set(volume.list_mtimes()) == {"a", "b", "c", "d"}
    (loc / "e").write_bytes(b"hello")
    assert volume.read_bytes("e") == b"hello" and volume.read_range("e", 1, 4) == b"ell"
    # Removed behind its back: gone for the volume too.
    (loc / "a").unlink()
    assert volume.size("a") is None and "a" not in volume.list_files()
    # The other order: a name first looked up missing, then created.
    assert volume.size("f") is None
    (loc / "f").write_bytes(b"x")
    assert volume.size("f") == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_second_instance_sees_a_later_checkpoint(tmp_path: Path, staging: Path, protocol: str) -> None:
    url = f"{protocol}://{tmp_path / 'run'}"
    publisher = CheckpointManager(FsspecVolume(url), keep_last=None, staging=Staging(mode="sync"))
    watcher = CheckpointManager(FsspecVolume(url, skip_instance_cache=True), staging=Staging(mode="sync"))
    assert watcher.root.fs is not publisher.root.fs
    publisher.save(1, state(1))
    assert watcher.latest() == 1 and [i.step for i in watcher.list()] == [1]
    publisher.save(2, state(2))
    assert "step_00000002" not in cached_names(watcher.root)  # stale: the test can fail
    assert watcher.latest() == 2
    assert [(i.step, i.published) for i in watcher.list()] == [(1, True), (2, True)]
    assert [(r.step, r.state) for r in list_root(watcher.root, check="all")] == [(1, "complete"), (2, "complete")]
    target = blank()
    assert watcher.load(target) == 2 and torch.equal(target["w"], state(2)["w"])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_one_shared_instance_for_writer_and_watcher(tmp_path: Path, staging: Path, protocol: str) -> None:
    # In one process fsspec hands both managers the same filesystem instance; it never invalidates
    # on write (tests/support/caching_fs.py), so the writer's own checks before publishing face the same
    # stale cache as the watcher.
    url = f"{protocol}://{tmp_path / 'run'}"
    publisher = CheckpointManager(url, keep_last=2, staging=Staging(mode="sync"))
    watcher = CheckpointManager(url, staging=Staging(mode="sync"))
    assert watcher.root.fs is publisher.root.fs
    publisher.save(1, state(1))
    assert watcher.latest() == 1
    scans = watcher.root.fs.listings
    publisher.save(2, state(2))  # would fail "not publishing ... has None bytes" on a stale listing
    publisher.save(3, state(3))
    assert watcher.root.fs.listings > scans
    assert watcher.latest() == 3
    assert [i.step for i in watcher.list()] == [2, 3]  # retention saw every checkpoint and deleted 1
    assert watcher.read_latest_pointer()["step"] == 3
    assert verify_checkpoint(watcher.root.child("step_00000003")).ok
    target = blank()
    assert watcher.load(target) == 3 and torch.equal(target["w"], state(3)["w"])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_second_process_watching_sees_a_later_checkpoint(tmp_path: Path, staging: Path, protocol: str) -> None:
    url = f"{protocol}://{tmp_path / 'run'}"
    publisher = CheckpointManager(url, keep_last=None, staging=Staging(mode="sync"))
    publisher.save(1, state(1))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "cache_watcher.py"), url],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def ask(command: str) -> str:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    try:
        assert ask("latest") == "LATEST 1"
        assert ask("list") == "LIST 1"
        publisher.save(2, state(2))
        assert ask("latest") == "LATEST 2"
        assert ask("list") == "LIST 1,2"
        _, err = proc.communicate("quit\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
