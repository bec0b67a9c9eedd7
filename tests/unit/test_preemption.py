"""The preemption flag (uc_checkpoint.ops.preemption) and the manager's final save, in one process."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import wait_for
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.preemption import PreemptionNotice


def test_notice_sets_a_flag_and_restores_handlers() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    notice = PreemptionNotice()
    notice.install((signal.SIGUSR1,))
    notice.install((signal.SIGUSR1,))  # twice: the first handler is still the one restored
    try:
        assert not notice.received
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: notice.received)
        assert notice.signal == signal.SIGUSR1
    finally:
        notice.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_manager_preemption_requested(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "run"))
    before = signal.getsignal(signal.SIGUSR2)
    manager.enable_preemption_save((signal.SIGUSR2,))
    try:
        assert manager.preemption_requested() is False
        os.kill(os.getpid(), signal.SIGUSR2)
        assert wait_for(manager.preemption_requested)
    finally:
        manager.disable_preemption_save()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_save_final_is_synchronous_without_touching_async_save(
    tmp_path: Path, staging: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CheckpointManager(str(tmp_path / "run"))
    calls: list[tuple[bool, bool]] = []
    from uc_checkpoint.ops import inflight

    start = inflight.start_dcp_save

    def spy(state_dict: Any, writer: Any, group: Any, *, asynchronous: bool, **kwargs: Any) -> Any:
        calls.append((asynchronous, manager.staging.asynchronous))
        return start(state_dict, writer, group, asynchronous=asynchronous, **kwargs)

    monkeypatch.setattr(inflight, "start_dcp_save", spy)
    manager.save(1, {"w": torch.ones(4)})
    assert manager.save_final(2, {"w": torch.full((4,), 2.0)}) is True
    assert calls == [(True, True), (False, True)]  # the final save is sync; the setting never flips
    assert manager.staging == Staging()
    assert manager.last_save is not None and manager.last_save.step == 2 and manager.last_save.ok
    assert manager.latest() == 2


def test_save_final_supersedes_a_save_in_flight_that_failed(
    tmp_path: Path, staging: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP fails a save with CheckpointException, a BaseException: the final save must still be
    taken, and it is the one that loads. An EIO from a mount cannot be caused here, so the first
    upload is made to fail as a dropped mount fails it."""
    from uc_checkpoint.errors import TransferError
    from uc_checkpoint.volumes import LocalVolume

    upload = LocalVolume.upload_file
    calls = {"n": 0}

    def first_fails(self: LocalVolume, local_path: Path, name: str, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise TransferError(f"copying {local_path} to {self.url_of(name)} failed: injected EIO")
        return upload(self, local_path, name, **kwargs)

    monkeypatch.setattr(LocalVolume, "upload_file", first_fails)
    manager = CheckpointManager(str(tmp_path / "run"))
    manager.save(1, {"w": torch.ones(4)})
    assert manager.save_final(2, {"w": torch.full((4,), 2.0)}) is True
    assert calls["n"] >= 2
    assert manager.latest() == 2
    out = {"w": torch.zeros(4)}
    assert manager.load(out) == 2 and torch.equal(out["w"], torch.full((4,), 2.0))
    assert [info.step for info in manager.list() if info.published] == [2]
