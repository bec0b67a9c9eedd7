"""CheckpointManager in one process: saves, retention, the latest pointer, finding the newest intact
checkpoint (skipping broken ones), loads, and listing errors that must never read as "no checkpoint"
(a real S3 server behind the fault-injecting proxy); and ``load()`` right after this manager's
own save, which must load that save (or raise its error), never an older step."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tests.conftest import HeldInWriteStep
from tests.support.s3_fixtures import FaultProxy
from uc_checkpoint import UCVolumeWriter
from uc_checkpoint.dcp.options import Staging, WriterOptions
from uc_checkpoint.errors import CheckpointNotFoundError, TransferError, VolumeError, rank_error
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
    manager = CheckpointManager(str(root), keep_last=None, staging=Staging(mode="sync"))
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
    manager = CheckpointManager(root, list_backoff_s=0.01, staging=Staging(mode="sync"))
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
    manager = CheckpointManager(str(root), keep_last=None, staging=Staging(mode="sync"))
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
    with pytest.raises(ValueError, match=r"Staging\.mode must be one of"):
        CheckpointManager("/tmp/x", staging=Staging(mode="fork"))
    with pytest.raises(ValueError, match="step must be >= 0"):
        CheckpointManager("/tmp/x").save(-1, {})
    with pytest.raises(TypeError, match="root must be"):
        CheckpointManager(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keep_last must be an int"):
        CheckpointManager("/tmp/x", keep_last="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an int"):
        CheckpointManager("/tmp/x").save("5", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="upload_workers must be an int"):
        UCVolumeWriter("/tmp/x", options=WriterOptions(upload_workers="4"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="path must be"):
        UCVolumeWriter(None)  # type: ignore[arg-type]


def test_pointer_never_moves_back_and_sync_save_returns_metadata(tmp_path: Path, staging: Path) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=None, staging=Staging(mode="sync"))
    assert manager.save(5, state(5)).result().storage_data  # DCP's Metadata, as async saves give
    manager.save(2, state(2))  # an older step saved again (e.g. a re-run)
    assert manager.read_latest_pointer()["step"] == 5
    assert manager.latest() == 5


def test_prune_keeps_protected_and_newer_unpublished_locations(tmp_path: Path, staging: Path) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=None, write_pointer=False, staging=Staging(mode="sync"))
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


class HeldAfterStaging(HeldInWriteStep):
    """:class:`~tests.conftest.HeldInWriteStep` that the save's CPU snapshot shares instead of
    copying (``copy.deepcopy`` returns it): the save stages, then is held in its write step, with
    nothing of it published, until the test sets ``release``."""

    def __deepcopy__(self, memo: dict[int, Any]) -> HeldAfterStaging:
        return self


def held_state(step: int, reached: threading.Event, release: threading.Event) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step, "held": HeldAfterStaging(reached, release)}


def load_while_held(manager: CheckpointManager, target: dict, step: int | None, release: threading.Event) -> int:
    """``manager.load(target, step)`` from another thread while this manager's save is held in
    flight; releases the save and returns what the load returned (raises what it raised), checking
    that the load was still waiting for the save when it was released."""
    outcome: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(("ok", manager.load(target, step)))
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
            outcome.append(("error", exc))

    thread = threading.Thread(target=run, name="test-load", daemon=True)
    thread.start()
    # Bounds how long a load that does not wait gets to resolve its step before the save is let go
    # (milliseconds); a load that waits is still waiting, whatever the bound.
    thread.join(0.5)
    waiting = thread.is_alive()
    release.set()
    thread.join(120)
    assert not thread.is_alive(), "load() did not return within 120 s of the save's release"
    kind, value = outcome[0]
    if kind == "error":
        raise value
    assert waiting, "load() returned while this manager's save was still in flight"
    return value


@pytest.fixture(params=["no-process-group", "one-rank-group"])
def one_rank(request: pytest.FixtureRequest) -> Iterator[None]:
    """One rank: no process group, or a real 1-rank gloo group (``single_rank_group``)."""
    if request.param == "one-rank-group":
        request.getfixturevalue("single_rank_group")
    yield


@pytest.mark.parametrize("background_copy", [False, True], ids=["staged-in-save", "background-copy"])
@pytest.mark.parametrize(
    ("published", "in_flight", "asked"),
    [((), 1, None), ((), 1, 1), ((1,), 2, None), ((1,), 2, 2)],
    ids=["save-1-load", "save-1-load-step-1", "1-published-save-2-load", "1-published-save-2-load-step-2"],
)
def test_load_waits_for_the_managers_own_save_in_flight(
    tmp_path: Path, staging: Path, one_rank: None, background_copy: bool, published: tuple, in_flight: int, asked
) -> None:
    """The save in flight is held after its staging (with async staging: staged, not uploaded), so
    ``load()`` is called while nothing of it is published: it must wait and load that step."""
    manager = CheckpointManager(str(tmp_path / "run"), keep_last=None, staging=Staging(background_copy=background_copy))
    for step in published:
        manager.save(step, {"w": torch.full((1000,), float(step)), "step": step})
        manager.wait()
    reached, release = threading.Event(), threading.Event()
    try:
        done = manager.save(in_flight, held_state(in_flight, reached, release))
        assert reached.wait(60), "the save never reached its write step"
        assert not done.done() and manager.latest() == (published[-1] if published else None)
        target = {"w": torch.zeros(1000), "step": -1}
        assert load_while_held(manager, target, asked, release) == in_flight
    finally:
        release.set()
    assert torch.equal(target["w"], torch.full((1000,), float(in_flight))) and target["step"] == in_flight
    assert done.done() and manager.last_save is not None and manager.last_save.ok
    manager.wait()  # nothing left in flight
    assert manager.latest() == in_flight


@pytest.mark.parametrize("asked", [None, 1], ids=["load", "load-step-1"])
def test_load_raises_the_error_of_the_save_in_flight_instead_of_loading_an_older_step(
    staging: Path, one_rank: None, s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, fast_retries, asked
) -> None:
    """Step 1 is published; the store then refuses every upload, so the save of step 2 fails in
    flight: ``load()`` raises that failure as :meth:`~CheckpointManager.wait` would, then (the error
    reported) loads step 1 again."""
    volume = S3Volume(f"s3://{s3_bucket}/inflight-fails", endpoint_url=fault_proxy.url, max_attempts=2)
    manager = CheckpointManager(volume, keep_last=None)
    manager.save(1, state(1))
    manager.wait()
    fault_proxy.match = lambda method, path: method == "PUT"
    fault_proxy.fail_all = True
    manager.save(2, state(2))
    with pytest.raises(CheckpointException) as exc:
        manager.load(blank(), step=asked)
    assert isinstance(rank_error(exc.value), TransferError), exc.value
    assert manager.last_save is not None and manager.last_save.step == 2 and not manager.last_save.ok
    fault_proxy.fail_all = False
    manager.wait()  # the error was raised once, as wait() raises it once
    target = blank()
    assert manager.load(target, step=asked) == 1 and torch.equal(target["w"], state(1)["w"])


@pytest.mark.slow
def test_two_ranks_agree_and_errors_reach_every_rank(tmp_path: Path, staging: Path) -> None:
    from tests.conftest import SCRIPTS, assert_ranks_ok, torchrun

    proc = torchrun(SCRIPTS / "manager_multirank.py", str(tmp_path), "agree", nproc=2, timeout=900)
    assert_ranks_ok(proc, 2, ("agree",))
    assert steps_on_disk(tmp_path / "run") == ["step_00000002", "step_00000003"]


@pytest.mark.slow
def test_two_ranks_load_waits_for_the_managers_own_save_in_flight(tmp_path: Path, staging: Path) -> None:
    """Every rank calls ``load()`` right after the manager's own async save: each loads the step
    just saved, or raises that save's error (mode ``inflight`` of the script)."""
    from tests.conftest import SCRIPTS, assert_ranks_ok, torchrun

    proc = torchrun(SCRIPTS / "manager_multirank.py", str(tmp_path), "inflight", nproc=2, timeout=600)
    assert_ranks_ok(proc, 2, ("inflight",))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("inflight-")) == ["inflight-fails"]


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
