"""CheckpointManager(staging=Staging(background_copy=True)): save() returns before the state is copied, and the copy
must be complete before the training loop changes the state. A ``Gate`` object inside the state
holds the background copy halfway (``copy.deepcopy`` of it blocks until released), so each test
knows exactly which tensors are copied when it changes them:

* the loop that calls ``wait_until_staged()`` before changing tensors in place gets the checkpoint of
  the save call, and waiting really waits for the copy (a time-out while it is held);
* the negative control: the same loop without the wait fails the save with
  ``StateChangedWhileStagingError`` and publishes nothing (so the check above is not vacuous);
* ``load()`` into the state being staged waits for the copy first.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.errors import StateChangedWhileStagingError
from uc_checkpoint.ops.manager import CheckpointManager


class Gate:
    """Holds a staging copy when the copy reaches it (cpu_snapshot deep-copies unknown objects)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_at = 0.0

    def open_after(self, seconds: float) -> None:
        def _open() -> None:
            time.sleep(seconds)
            self.released_at = time.perf_counter()
            self.release.set()

        threading.Thread(target=_open, daemon=True).start()

    def __deepcopy__(self, memo: dict[int, Any]) -> str:
        self.entered.set()
        assert self.release.wait(60), "the gate was never opened"
        return "gate"


def state(seed: int, gate: Gate | None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    # Dict order is copy order: "a" is copied before the gate, "z" after it.
    return {"a": torch.randn(256, generator=g), "gate": gate, "z": torch.randn(64, 8, generator=g), "step": seed}


def blank() -> dict[str, Any]:
    return {"a": torch.zeros(256), "gate": None, "z": torch.zeros(64, 8), "step": None}


def train_step(sd: dict[str, Any]) -> None:
    with torch.no_grad():  # what optimizer.step() does: in place
        sd["a"].add_(1000.0)
        sd["z"].mul_(-2.0)


def test_the_checkpoint_is_the_state_of_the_save_call_when_the_loop_waits(tmp_path: Path, staging: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "run"), staging=Staging(background_copy=True))
    gate = Gate()
    sd = state(1, gate)
    expected = state(1, None)
    t0 = time.perf_counter()
    manager.save(1, sd)
    assert gate.entered.wait(30)  # save() returned; the copy is running and held halfway
    assert manager.last_save is None  # nothing recorded: the save is still in flight
    with pytest.raises(TimeoutError):
        manager.wait_until_staged(timeout=0.05)  # it really waits for the copy
    gate.open_after(0.2)
    manager.wait_until_staged()
    returned = time.perf_counter()
    assert gate.release.is_set() and gate.released_at <= returned and returned - t0 >= 0.2
    train_step(sd)  # the next optimizer step, right after the wait
    manager.wait()
    assert manager.last_save is not None and manager.last_save.ok
    target = blank()
    assert manager.load(target) == 1
    assert torch.equal(target["a"], expected["a"]) and torch.equal(target["z"], expected["z"])
    assert target["gate"] == "gate" and target["step"] == 1


def test_a_loop_that_skips_the_wait_fails_the_save_instead_of_publishing_a_mixed_one(
    tmp_path: Path, staging: Path
) -> None:
    manager = CheckpointManager(str(tmp_path / "run"), staging=Staging(background_copy=True))
    gate = Gate()
    sd = state(2, gate)
    manager.save(2, sd)
    assert gate.entered.wait(30)
    train_step(sd)  # the misuse: "a" was copied already, "z" not yet
    gate.open_after(0.0)
    with pytest.raises(StateChangedWhileStagingError, match="changed in place while they were being staged"):
        manager.wait()
    assert manager.last_save is not None and not manager.last_save.ok
    assert manager.latest() is None
    assert not (tmp_path / "run" / "step_00000002" / ".metadata").exists()
    # The manager goes on: the next save (the loop waits this time) publishes.
    manager.save(3, state(3, None))
    manager.wait_until_staged()
    manager.wait()
    assert manager.latest() == 3


def test_load_into_the_state_being_staged_waits_for_the_copy(tmp_path: Path, staging: Path) -> None:
    manager = CheckpointManager(str(tmp_path / "run"), keep_last=None, staging=Staging(background_copy=True))
    manager.save(1, state(1, None))
    manager.wait()
    gate = Gate()
    sd = state(2, gate)
    manager.save(2, sd)
    assert gate.entered.wait(30)
    gate.open_after(0.2)
    assert manager.load(sd, step=1) == 1  # overwrites sd in place: only after the copy is complete
    assert gate.released_at > 0
    assert torch.equal(sd["a"], state(1, None)["a"])
    manager.wait()
    target = blank()
    manager.load(target, step=2)
    assert torch.equal(target["a"], state(2, None)["a"]) and torch.equal(target["z"], state(2, None)["z"])


def test_a_background_copy_needs_an_async_save(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="background_copy=True needs mode 'thread' or 'process'"):
        Staging(mode="sync", background_copy=True)
    # Without async staging, save() returns after the copy: waiting is a no-op.
    manager = CheckpointManager(str(tmp_path / "run"))
    manager.wait_until_staged()
    manager.save(1, state(1, None))
    manager.wait_until_staged(timeout=0)
    manager.wait()
