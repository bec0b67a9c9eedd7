"""``CheckpointManager.should_save`` in a real 2-rank loop (torchrun, gloo): ranks whose steps take
different times save at exactly the same steps, and those checkpoints publish."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SCRIPTS, assert_ranks_ok, torchrun


def test_should_save_agrees_across_ranks(tmp_path: Path) -> None:
    proc = torchrun(SCRIPTS / "interval_multirank.py", str(tmp_path), nproc=2, timeout=300)
    assert_ranks_ok(proc, 2, ["every_seconds", "blocked_fraction"])
