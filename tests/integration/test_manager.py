"""CheckpointManager in one process: saves, retention, the latest pointer, finding the newest intact
checkpoint (skipping broken ones), loads, and listing errors that must never read as "no checkpoint"
(a real S3 server behind the fault-injecting proxy)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.s3_fixtures import FaultProxy
from uc_checkpoint import UCVolumeWriter
from uc_checkpoint.errors import CheckpointNotFoundError, TransferError, VolumeError
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.volumes import LocalVolume, S3Volume


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g), "meta": {"step": step}}


def blank() -> dict:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(7), "meta": {"step": -1}}


def steps_on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def test_save_retention_pointer_latest_and_load(tmp_path: Path, staging: Path) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=2, keep_every=3)
    for step in range(1, 8):
        manager.save(step, state(step))
    manager.wait()
    # Newest two (6, 7) plus every multiple of 3 (3, 6); 1, 2, 4, 5 deleted, directories included.
    assert steps_on_disk(root) == ["step_00000003", "step_00000006", "step_00000007"]
    assert [(i.step, i.published) for i in manager.list()] == [(3, True), (6, True), (7, True)]
    pointer = json.loads((root / "latest").read_text())
    assert pointer["step"] == 7 and pointer["name"] == "step_00000007"
    assert manager.latest() == 7
    target = blank()
    assert manager.load(target) == 7
    assert torch.equal(target["w"], state(7)["w"]) and target["meta"] == {"step": 7}
    target = blank()
    assert manager.load(target, step=3) == 3
    assert torch.equal(target["b"], state(3)["b"])


def test_no_checkpoint_is_none_and_load_says_so(tmp_path: Path, staging: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "fresh"))
    assert manager.latest() is None and manager.list() == []
    with pytest.raises(CheckpointNotFoundError, match="no published checkpoint under .*fresh"):
        manager.load(blank())


def test_latest_skips_broken_and_unpublished_checkpoints(tmp_path: Path, staging: Path, caplog) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=None, async_save=False)
    for step in (1, 2, 3, 4):
        manager.save(step, state(step))
    # 4: a data file is missing; 3: a data file was truncated; 2: .metadata is garbage.
    next((root / "step_00000004").glob("*.distcp")).unlink()
    victim = next((root / "step_00000003").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:100])
    (root / "step_00000002" / ".metadata").write_bytes(b"not a pickle")
    # 5: a save that never finished (data files, no .metadata).
    (root / "step_00000005").mkdir()
    (root / "step_00000005" / "__0_deadbeef_0.distcp").write_bytes(b"x" * 10)
    with caplog.at_level(logging.WARNING, logger="uc_checkpoint.ops.manager"):
        assert manager.latest() == 1
    text = caplog.text
    assert "step_00000004" in text and "is missing" in text
    assert f"{victim.name} has 100 bytes" in text
    assert "step_00000002" in text
    target = blank()
    assert manager.load(target) == 1 and torch.equal(target["w"], state(1)["w"])


def test_failed_save_keeps_the_previous_checkpoint(
    tmp_path: Path, staging: Path, s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, fast_retries
) -> None:
    def volume() -> S3Volume:
        return S3Volume(f"s3://{s3_bucket}/keep", endpoint_url=fault_proxy.url, max_attempts=2)

    manager = CheckpointManager(volume(), keep_last=1)
    manager.save(1, state(1))
    manager.wait()
    fault_proxy.match = lambda method, path: method == "PUT"
    fault_proxy.fail_all = True
    manager.save(2, state(2))
    with pytest.raises(CheckpointException):
        manager.wait()
    fault_proxy.fail_all = False
    assert manager.latest() == 1  # keep_last=1 pruned nothing: step 2 was never published
    published = {i.step: i.published for i in manager.list()}
    assert published[1] and not published.get(2, False)
    target = blank()
    assert manager.load(target) == 1 and torch.equal(target["w"], state(1)["w"])


@pytest.mark.parametrize(
    ("fails", "call", "match"),
    [
        (  # latest(): the root's listing
            lambda method, path: method == "GET" and "list-type=2" in path,
            lambda manager: manager.latest(),
            r"cannot list checkpoints under s3://.*/listed after 5 attempts",
        ),
        (  # load(step=N): the lookup of the step's .metadata
            lambda method, path: method == "HEAD" and path.endswith("/.metadata"),
            lambda manager: manager.load(blank(), step=4),
            r"step_00000004/\.metadata .*after 5 attempts",
        ),
    ],
    ids=["listing", "load-lookup"],
)
def test_store_errors_are_retried_then_raised_never_taken_for_no_checkpoint(
    s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, fast_retries, staging: Path, fails, call, match
) -> None:
    root = S3Volume(f"s3://{s3_bucket}/listed", endpoint_url=fault_proxy.url, max_attempts=1)
    manager = CheckpointManager(root, async_save=False, list_backoff_s=0.01)
    manager.save(4, state(4))
    fault_proxy.match = fails
    fault_proxy.fail_all = True
    with pytest.raises(VolumeError, match=match) as exc:
        call(manager)
    assert isinstance(exc.value.__cause__, TransferError)
    fault_proxy.fail_all = False
    fault_proxy.error_rate = 0.5  # half of these requests fail: retries get through
    assert call(manager) == 4


def test_loading_a_step_that_was_never_published_raises_not_found_itself(tmp_path: Path, staging: Path) -> None:
    """Not DCP's CheckpointException around it: that is a BaseException, which a caller's
    ``except CheckpointNotFoundError`` (or ``except Exception``) would not catch."""
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=None, async_save=False)
    manager.save(1, state(1))
    (root / "step_00000002").mkdir()  # 2: a save that never finished (data files, no .metadata)
    (root / "step_00000002" / "__0_deadbeef_0.distcp").write_bytes(b"x" * 10)
    for step in (2, 3):  # 3: never saved
        with pytest.raises(CheckpointNotFoundError, match=rf"at step {step}: .*step_0000000{step}/\.metadata does not"):
            manager.load(blank(), step=step)
    target = blank()
    assert manager.load(target, step=1) == 1 and torch.equal(target["w"], state(1)["w"])


def test_missing_bucket_is_an_error_not_an_empty_root(s3_server: str, fast_retries) -> None:
    manager = CheckpointManager(S3Volume("s3://no-such-bucket-here/run", endpoint_url=s3_server))
    with pytest.raises(VolumeError, match="no-such-bucket-here"):
        manager.latest()
    # A given step is looked up with a HEAD, whose 404 reads the same for a missing key and a
    # missing bucket: a typo in the bucket must not read as "start from scratch".
    with pytest.raises(VolumeError, match="bucket 'no-such-bucket-here' does not exist"):
        manager.load(blank(), step=5)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager("/tmp/x", keep_last=0)
    with pytest.raises(ValueError, match="async_mode"):
        CheckpointManager("/tmp/x", async_mode="fork")
    with pytest.raises(ValueError, match="step must be >= 0"):
        CheckpointManager("/tmp/x").save(-1, {})
    with pytest.raises(TypeError, match="root must be"):
        CheckpointManager(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keep_last must be an int"):
        CheckpointManager("/tmp/x", keep_last="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an int"):
        CheckpointManager("/tmp/x").save("5", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="upload_workers must be an int"):
        UCVolumeWriter("/tmp/x", upload_workers="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="path must be"):
        UCVolumeWriter(None)  # type: ignore[arg-type]


def test_pointer_never_moves_back_and_sync_save_returns_metadata(tmp_path: Path, staging: Path) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=None, async_save=False)
    assert manager.save(5, state(5)).result().storage_data  # DCP's Metadata, as async saves give
    manager.save(2, state(2))  # an older step saved again (e.g. a re-run)
    assert manager.read_latest_pointer()["step"] == 5
    assert manager.latest() == 5


def test_prune_keeps_protected_and_newer_unpublished_locations(tmp_path: Path, staging: Path) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=None, async_save=False, write_pointer=False)
    for step in (1, 2, 3):
        manager.save(step, state(step))
    # An unpublished newer location (another job's save in progress, or a crash leftover) is not
    # retention's business.
    (root / "step_00000009").mkdir()
    (root / "step_00000009" / "__0_x_0.distcp").write_bytes(b"1")
    manager.keep_last = 1
    assert manager.prune(protect={2}) == [1]
    assert steps_on_disk(root) == ["step_00000002", "step_00000003", "step_00000009"]
    assert manager.prune() == [2]
    assert LocalVolume(root / "step_00000003").size(".metadata") is not None


@pytest.mark.slow
def test_two_ranks_agree_and_errors_reach_every_rank(tmp_path: Path, staging: Path) -> None:
    from tests.conftest import SCRIPTS, torchrun

    proc = torchrun(SCRIPTS / "manager_multirank.py", str(tmp_path), nproc=2, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "RANK 0 OK" in proc.stdout and "RANK 1 OK" in proc.stdout, out[-6000:]
    assert steps_on_disk(tmp_path / "run") == ["step_00000002", "step_00000003"]


@pytest.mark.slow
def test_sigterm_takes_a_final_checkpoint(tmp_path: Path, staging: Path) -> None:
    """A real SIGTERM to a real training process: it finishes the step, saves it, exits 0."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO, SCRIPTS

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "preempted_loop.py"), str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.strip())
            if line.startswith("STEP 7"):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines += rest.splitlines()
    assert proc.returncode == 0, "\n".join(lines[-40:])
    final = [ln for ln in lines if ln.startswith("FINAL")]
    assert len(final) == 1 and final[0].endswith(" True"), lines[-20:]
    step = int(final[0].split()[1])
    assert step >= 7
    manager = CheckpointManager(str(tmp_path / "run"))
    assert manager.latest() == step
    target = {"w": torch.zeros(64, 64), "step": -1}
    assert manager.load(target) == step
    assert torch.equal(target["w"], torch.full((64, 64), float(step))) and target["step"] == step
