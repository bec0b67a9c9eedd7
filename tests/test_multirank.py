"""Two real ranks under torchrun (gloo on CPU): save with UCVolumeWriter in every DCP mode, load
resharded, partially, and with the stock reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import SCRIPTS, torchrun

MODES = ("sync", "thread", "process")


@pytest.mark.slow
def test_two_ranks_all_modes(tmp_path: Path) -> None:
    proc = torchrun(SCRIPTS / "multirank_roundtrip.py", str(tmp_path), *MODES, nproc=2, timeout=1400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for mode in MODES:
        for rank in (0, 1):
            assert f"RANK {rank} {mode} OK" in proc.stdout, out[-4000:]
        assert (tmp_path / mode / ".metadata").is_file()
