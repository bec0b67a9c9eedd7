"""Real faults on the staging disk: a full staging filesystem (a 1 MiB tmpfs, so ENOSPC comes from
the kernel) and the staging directory deleted while a save runs. Each must give a clear error naming
the cause, publish nothing, and leave the previous checkpoint loadable. And a volume mounted
read-only: the save fails with a VolumeError naming it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.conftest import cause, causes, make_state_dict
from tests.support.tmpfs import mounted_tmpfs
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.errors import StagingError, VolumeError


def state(seed: int, mib: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * (1 << 18), generator=g), "meta": {"seed": seed}}


@pytest.fixture(params=["1m", "8m"])
def tiny_staging(tmp_path: Path, request: pytest.FixtureRequest):
    """A small tmpfs used as the staging root (needs root, as the tests' FUSE mounts do): 1 MiB,
    full at once; 8 MiB, which the save fills part way, so that megabytes are free again once the
    write that failed is cleaned up."""
    with mounted_tmpfs(tmp_path / "tiny", request.param) as mnt:
        yield mnt


def test_staging_disk_full(tmp_path: Path, tiny_staging: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(state(1), storage_writer=UCVolumeWriter(dest))  # the previous good checkpoint (normal staging)
    before = sorted(p.name for p in dest.iterdir())
    big = {**state(2), **{f"more{i}": torch.randn(3 << 18) for i in range(4)}}  # 16 MiB in 3-4 MiB files
    with pytest.raises(CheckpointException) as exc:
        dcp.save(
            big,
            storage_writer=UCVolumeWriter(
                dest, staging_dir=tiny_staging, options=WriterOptions(file_size_bytes=3 << 20)
            ),
        )
    ours = [e for e in causes(exc.value) if isinstance(e, StagingError)]
    assert ours, [repr(e) for e in causes(exc.value)]
    assert "is full" in str(ours[0]) and str(tiny_staging) in str(ours[0]), str(ours[0])  # what and where
    assert "UC_CHECKPOINT_STAGING_DIR" in str(ours[0]) and "staging_dir=" in str(ours[0])  # and what to do
    assert sorted(p.name for p in dest.iterdir() if p.name == ".metadata") == [".metadata"]
    assert [p for p in dest.iterdir() if p.name == ".metadata"][0].read_bytes()  # still the old one
    out = {"w": torch.zeros_like(state(1)["w"]), "meta": {"seed": -1}}
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert torch.equal(out["w"], state(1)["w"]) and out["meta"] == {"seed": 1}
    assert {".metadata"} <= set(before)
    assert not any(tiny_staging.rglob("*.distcp"))  # staging cleaned up after the failure


class StagingVandal:
    """A state-dict value whose serialisation deletes everything under the staging root.

    DCP pickles non-tensor values into the data files before it writes the tensors, so the staging
    directory really disappears at a fixed point in the middle of the save (a background thread
    deleting it raced with the save and sometimes lost)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __getstate__(self) -> dict:
        for child in self.root.iterdir():
            shutil.rmtree(child, ignore_errors=True)
        return {"root": str(self.root)}


def test_staging_dir_deleted_during_save(tmp_path: Path, staging: Path) -> None:
    dest = tmp_path / "ckpt"
    dcp.save(state(3), storage_writer=UCVolumeWriter(dest))
    meta_before = (dest / ".metadata").read_bytes()
    doomed = {**state(4, mib=16), "vandal": StagingVandal(staging)}
    with pytest.raises(CheckpointException) as exc:
        dcp.save(doomed, storage_writer=UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=1 << 20)))
    ours = [e for e in causes(exc.value) if isinstance(e, StagingError)]
    assert ours and "disappeared during the save" in str(ours[0]), [repr(e) for e in causes(exc.value)]
    assert "UC_CHECKPOINT_STAGING_DIR" in str(ours[0])
    assert (dest / ".metadata").read_bytes() == meta_before  # nothing published over the old one
    out = {"w": torch.zeros_like(state(3)["w"]), "meta": {"seed": -1}}
    dcp.load(out, storage_reader=UCVolumeReader(dest))
    assert torch.equal(out["w"], state(3)["w"])


def test_read_only_volume(tmp_path: Path, staging: Path) -> None:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        with pytest.raises(CheckpointException) as ei:
            dcp.save(make_state_dict(), storage_writer=UCVolumeWriter(mnt / "ckpt"))
        assert isinstance(cause(ei), VolumeError) and str(mnt) in str(cause(ei))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
