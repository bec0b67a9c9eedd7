"""Garbage collection of failed saves' leftovers: old unpublished locations, unreferenced files in
published ones, incomplete multipart uploads (real S3 server) and stale staging directories; recent
files (a save may be in progress) and every published checkpoint are spared."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests.support.s3_fixtures import s3_client
from uc_checkpoint.cli import main as cli_main
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops.garbage import collect_garbage
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.volumes import S3Volume

DAY = 86400.0


def state(step: int) -> dict:
    return {"w": torch.full((32, 8), float(step)), "meta": {"step": step}}


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_local_leftovers_collected_checkpoints_and_recent_files_spared(tmp_path: Path, staging: Path, capsys) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=None, staging=Staging(mode="sync"))
    manager.save(1, state(1))
    manager.save(2, state(2))
    for p in root.rglob("*"):
        age(p, 2 * DAY)  # the checkpoints themselves are old: they must survive anyway
    dead = root / "step_00000003"  # a crashed save, long ago
    dead.mkdir()
    (dead / "__0_aaaa_0.distcp").write_bytes(b"x" * 100)
    (dead / "__1_aaaa_0.distcp").write_bytes(b"y" * 50)
    for p in dead.iterdir():
        age(p, DAY)
    busy = root / "step_00000004"  # a save in progress right now
    busy.mkdir()
    (busy / "__0_bbbb_0.distcp").write_bytes(b"z" * 10)
    orphan = root / "step_00000002" / "__0_cccc_0.distcp"  # a failed re-save at a published location
    orphan.write_bytes(b"o" * 7)
    age(orphan, DAY)
    fresh_orphan = root / "step_00000001" / "__0_dddd_0.distcp"  # a re-save in progress there
    fresh_orphan.write_bytes(b"n" * 3)
    # Staging without an owner record (a host whose records are lost): collected by age.
    old_stage = staging / f"uc-checkpoint-{os.geteuid()}" / "save-111111111111-222222222222-rank-0"
    old_stage.mkdir(parents=True)
    (old_stage / "__0_0.distcp").write_bytes(b"s")
    for p in (old_stage / "__0_0.distcp", old_stage):
        age(p, DAY)
    new_stage = old_stage.with_name("save-333333333333-444444444444-rank-0")
    new_stage.mkdir()

    dry = collect_garbage(str(root), grace_s=3600, staging_dir=staging, dry_run=True)
    assert sorted(Path(p).name for p in dry.deleted_files) == [
        "__0_aaaa_0.distcp",
        "__0_cccc_0.distcp",
        "__1_aaaa_0.distcp",
    ]
    assert dry.deleted_bytes == 157 and dead.exists() and orphan.exists() and old_stage.exists()

    assert cli_main(["gc", str(root), "--grace-s", "3600", "--staging-dir", str(staging)]) == 0
    out = capsys.readouterr().out
    assert "deleted 3 files (157 bytes), 1 staging dirs" in out
    assert not dead.exists() and not orphan.exists() and not old_stage.exists()
    assert busy.exists() and fresh_orphan.exists() and new_stage.exists()
    assert f"spared {busy}" in out and f"spared {root / 'step_00000001'}" in out
    for step in (1, 2):  # both checkpoints still load
        target = {"w": torch.zeros(32, 8), "meta": {"step": -1}}
        assert manager.load(target, step=step) == step and torch.equal(target["w"], state(step)["w"])


def test_s3_incomplete_uploads_and_unpublished_objects(s3_server: str, s3_bucket: str, staging: Path) -> None:
    root = S3Volume(f"s3://{s3_bucket}/gc-run", endpoint_url=s3_server)
    manager = CheckpointManager(root, keep_last=None, staging=Staging(mode="sync"))
    manager.save(5, state(5))
    client = s3_client(s3_server)
    client.put_object(Bucket=s3_bucket, Key="gc-run/step_00000006/__0_eeee_0.distcp", Body=b"x" * 11)
    spared = collect_garbage(root, grace_s=3600, include_staging=False)
    assert spared.deleted_files == []
    assert spared.spared_locations == [root.child("step_00000006").url]

    # (moto reports every multipart upload as initiated in 2010, so the age filter on uploads cannot
    # be exercised against it; the upload is created after the first pass instead.)
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key="gc-run/step_00000006/__0_eeee_1.distcp")
    client.upload_part(
        Bucket=s3_bucket,
        Key="gc-run/step_00000006/__0_eeee_1.distcp",
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=b"p" * 1024,
    )

    report = collect_garbage(root, grace_s=0, include_staging=False)
    assert [u.rsplit("/", 2)[-2:] for u in report.deleted_files] == [["step_00000006", "__0_eeee_0.distcp"]]
    assert report.aborted_uploads == 1
    assert not client.list_multipart_uploads(Bucket=s3_bucket, Prefix="gc-run/").get("Uploads")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="gc-run/")["Contents"]]
    assert all(k.startswith("gc-run/step_00000005/") or k == "gc-run/latest" for k in keys), keys
    assert manager.latest() == 5


def test_unreadable_metadata_leaves_the_location_alone(tmp_path: Path, staging: Path) -> None:
    root = tmp_path / "run"
    CheckpointManager(str(root), staging=Staging(mode="sync")).save(1, state(1))
    loc = root / "step_00000001"
    (loc / ".metadata").write_bytes(b"garbage")
    for p in loc.iterdir():
        age(p, DAY)
    report = collect_garbage(str(root), grace_s=0, include_staging=False)
    assert report.deleted_files == [] and report.spared_locations == [str(loc)]
    assert len(list(loc.iterdir())) > 1


def test_negative_grace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="grace_s"):
        collect_garbage(str(tmp_path), grace_s=-1)


def test_gc_on_a_single_location_and_bad_roots(tmp_path: Path, staging: Path) -> None:
    # A root that is itself one checkpoint location: a failed re-save's files go, the published
    # checkpoint and a user's own file stay. A missing root is an error, not "deleted 0 files".
    import torch
    import torch.distributed.checkpoint as dcp

    from uc_checkpoint import UCVolumeReader, UCVolumeWriter
    from uc_checkpoint.errors import VolumeError

    loc = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(1000)}, storage_writer=UCVolumeWriter(loc))
    (loc / "__0_deadbeef_0.distcp").write_bytes(b"x" * 100)  # a failed save's file
    (loc / "notes.txt").write_text("mine")
    report = collect_garbage(loc, grace_s=0, include_staging=False)
    assert [Path(f).name for f in report.deleted_files] == ["__0_deadbeef_0.distcp"], report
    assert (loc / "notes.txt").exists()
    out = {"w": torch.zeros(1000)}
    dcp.load(out, storage_reader=UCVolumeReader(loc))
    assert torch.equal(out["w"], torch.ones(1000))
    with pytest.raises(VolumeError, match="does not exist"):
        collect_garbage(tmp_path / "no-such-root", grace_s=0)
    assert cli_main(["gc", str(tmp_path / "no-such-root"), "--grace-s", "0"]) == 2
    assert cli_main(["gc", str(loc), "--grace-s", "-5"]) == 2


def test_a_dry_run_does_not_claim_to_have_aborted_uploads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    (root / "step_00000001").mkdir(parents=True)
    assert cli_main(["gc", "--dry-run", "--grace-s", "0", str(root)]) == 0
    out = capsys.readouterr().out
    assert "aborted" not in out and "left for a run without --dry-run" in out
    assert cli_main(["gc", "--grace-s", "0", str(root)]) == 0
    assert "aborted 0 multipart uploads" in capsys.readouterr().out
