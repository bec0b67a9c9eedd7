"""Rollbacks are not silently undone (issue 13, item 7): after a run resumes from an older step and
saves, ``latest()`` and retention follow the run's line, not the highest step number."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from uc_checkpoint.format.layout import ABANDONED_NAME
from uc_checkpoint.ops.garbage import collect_garbage
from uc_checkpoint.ops.lineage import abandonment_marker, marker_applies, newer_published, retention_plan
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.summary import list_root
from uc_checkpoint.ops.verify import verify_checkpoint


@pytest.mark.parametrize(
    ("published", "keep_last", "keep_every", "protect", "deleted"),
    [
        ([(1, False), (2, False), (3, False)], 2, None, (), [1]),
        ([(1, False), (2, False), (3, False)], None, None, (), []),
        ([(1, False), (2, False), (3, False)], 5, None, (), []),
        ([(1, False), (2, False), (3, False), (4, False)], 1, 2, (), [1, 3]),
        ([(1, False), (2, False), (3, False)], 1, None, (1,), [2]),
        # After a rollback to 100: 200 is abandoned, so it is the oldest.
        ([(100, False), (110, False), (200, True)], 2, None, (110,), [200]),
        ([(100, False), (110, False), (120, False), (200, True)], 2, None, (120,), [200, 100]),
        ([(100, False), (110, False), (200, True)], 3, None, (), []),
        # keep_every still keeps an abandoned multiple.
        ([(100, False), (110, False), (120, False), (200, True)], 2, 100, (), [100])
        if False
        else ([(100, False), (110, False), (120, False), (200, True)], 2, 200, (), [100]),
        ([(100, True), (200, True)], 1, None, (), [100]),
    ],
)
def test_retention_plan(published, keep_last, keep_every, protect, deleted) -> None:
    assert retention_plan(published, keep_last=keep_last, keep_every=keep_every, protect=protect) == deleted


def test_markers_apply_to_the_checkpoint_they_name() -> None:
    raw = abandonment_marker("save-a", 110, 100)
    assert marker_applies(raw, {"save_id": "save-a"})
    assert not marker_applies(raw, {"save_id": "save-b"})  # the location was saved again since
    assert marker_applies(abandonment_marker(None, 110, None), None)
    assert not marker_applies(b"not json", {"save_id": "save-a"})
    assert not marker_applies(None, {"save_id": "save-a"})
    assert newer_published([100, 200, 300], 150) == [200, 300]


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step)), "step": torch.tensor(step)}


def saved_step(manager: CheckpointManager, step: int | None = None) -> int:
    target = state(0)
    loaded = manager.load(target, step=step)
    assert int(target["step"]) == loaded and torch.equal(target["w"], torch.full((64,), float(loaded)))
    return loaded


def published(root: Path | str) -> list[int]:
    return [s.step for s in list_root(str(root), check="all") if s.state in ("complete", "abandoned")]


def run(root: str, steps: list[int], *, resume: int | None = None, keep_last: int | None = 2) -> CheckpointManager:
    """A new job on ``root``: loads ``resume`` (when given), saves ``steps``, waits."""
    manager = CheckpointManager(root, keep_last=keep_last)
    if resume is not None:
        assert saved_step(manager, resume) == resume
    for step in steps:
        manager.save(step, state(step))
    manager.wait()
    return manager


def _rollback_sequence(root: str, caplog: pytest.LogCaptureFixture) -> None:
    run(root, [100, 200])
    with caplog.at_level(logging.WARNING, logger="uc_checkpoint.ops.manager"):
        run(root, [110, 120, 130], resume=100)
    assert "rollback" in caplog.text and "[200]" in caplog.text
    fresh = CheckpointManager(root, keep_last=2)
    assert fresh.latest() == 130
    assert saved_step(fresh) == 130
    assert published(root) == [120, 130]  # 200, the abandoned branch, went first
    # A second rollback, to 120.
    run(root, [125], resume=120)
    fresh = CheckpointManager(root, keep_last=2)
    assert fresh.latest() == 125
    assert published(root) == [120, 125]


def test_a_rollback_is_not_undone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _rollback_sequence(str(tmp_path / "root"), caplog)
    pointer = CheckpointManager(str(tmp_path / "root")).read_latest_pointer()
    assert pointer is not None and pointer["step"] == 125


def test_a_rollback_is_not_undone_on_s3(
    s3_server: str, s3_bucket: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    _rollback_sequence(f"s3://{s3_bucket}/lineage", caplog)


def test_abandoned_checkpoints_are_listed_verified_and_kept_by_gc(tmp_path: Path) -> None:
    root = tmp_path / "root"
    run(str(root), [100, 200, 300], keep_last=None)
    run(str(root), [110], resume=100, keep_last=None)
    states = {s.step: s for s in list_root(str(root), check="all")}
    assert [states[s].state for s in (100, 110, 200, 300)] == ["complete", "complete", "abandoned", "abandoned"]
    assert "rollback" in (states[200].problem or "") and "step 110" in (states[200].problem or "")
    assert CheckpointManager(str(root)).latest() == 110
    assert verify_checkpoint(str(root / "step_00000200")).ok  # intact, only abandoned
    collect_garbage(str(root), grace_s=0.0, include_staging=False)
    assert (root / "step_00000200" / ABANDONED_NAME).is_file()
    assert CheckpointManager(str(root)).latest() == 110


def test_loading_an_abandoned_step_and_saving_takes_it_back(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    run(root, [100, 200], keep_last=None)
    run(root, [110], resume=100, keep_last=None)
    assert CheckpointManager(root).latest() == 110
    run(root, [210], resume=200, keep_last=None)
    assert not (tmp_path / "root" / "step_00000200" / ABANDONED_NAME).exists()
    fresh = CheckpointManager(root)
    assert fresh.latest() == 210
    assert saved_step(fresh, 200) == 200


def test_the_new_line_saving_an_abandoned_step_again_replaces_it(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    run(root, [100, 200], keep_last=None)
    run(root, [150, 200], resume=100, keep_last=None)  # the new line reaches 200 again
    assert not (tmp_path / "root" / "step_00000200" / ABANDONED_NAME).exists()
    fresh = CheckpointManager(root)
    assert fresh.latest() == 200
    target = state(0)
    fresh.load(target)
    assert int(target["step"]) == 200


def test_a_fresh_start_below_published_steps_abandons_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "root")
    run(root, [100, 200], keep_last=None)
    with caplog.at_level(logging.WARNING, logger="uc_checkpoint.ops.manager"):
        run(root, [10], keep_last=None)  # no load: a run started from scratch on the same root
    assert "below published step(s) [100, 200]" in caplog.text
    assert CheckpointManager(root).latest() == 10


def test_resuming_the_newest_step_abandons_nothing(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    run(root, [100, 200])
    manager = run(root, [300], resume=200)
    assert not list((tmp_path / "root").glob(f"*/{ABANDONED_NAME}"))
    assert manager.latest() == 300 and published(root) == [200, 300]


def test_taking_back_a_step_after_latest_saw_it_abandoned_keeps_it(tmp_path: Path) -> None:
    # latest() notes the abandoned step; loading it and saving from it must clear that note too,
    # or retention deletes the very step the run resumed from.
    root = str(tmp_path / "root")
    run(root, [100, 200], keep_last=None)
    run(root, [110], resume=100, keep_last=None)
    manager = CheckpointManager(root, keep_last=2)
    assert manager.latest() == 110
    saved_step(manager, 200)
    manager.save(210, state(210))
    manager.wait()
    assert published(root) == [200, 210]
    assert CheckpointManager(root).latest() == 210


def test_a_marker_that_still_applies_is_not_written_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a mount that refuses to overwrite and to delete the marker, each restart of the rolled-back
    # line must still save.
    from tests.unit.test_refusing_mounts import RefusingMount

    root = tmp_path / "root"
    run(str(root), [100, 200], keep_last=None)
    RefusingMount(root, monkeypatch, refuse_deleting=ABANDONED_NAME)
    run(str(root), [110], resume=100, keep_last=None)
    run(str(root), [120], resume=110, keep_last=None)  # 200 is still above: its marker already applies
    run(str(root), [130], resume=120, keep_last=None)
    assert CheckpointManager(str(root)).latest() == 130
