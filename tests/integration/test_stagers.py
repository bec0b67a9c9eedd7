"""Our writer under DCP's own stager: ``dcp.async_save(..., async_stager=DefaultStager(...))`` with
synchronous and asynchronous staging, with and without shared memory, in DCP's THREAD and PROCESS
modes (PROCESS pickles the writer and the staged state into its daemon), on two real ranks (gloo on
CPU), beside the writer's own ``stage()``. Every checkpoint loads back resharded with the values of
the save call although training changed every tensor in place as soon as the staging was done;
and CheckpointManager(staging=Staging(background_copy=True)) in both modes (``wait_until_staged()``, then the step),
and CheckpointManager(staging=Staging(reuse_buffers=True)) in THREAD mode (two saves, each its own values)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, torchrun

STAGERS = ("writer", "dcp-sync", "dcp-async", "dcp-shm-sync", "dcp-shm-async")


@pytest.mark.slow
def test_every_stager_in_thread_and_process_mode_round_trips(tmp_path: Path) -> None:
    proc = torchrun(SCRIPTS / "stager_modes.py", str(tmp_path / "vol"), nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Found anywhere: the ranks share one pipe, and their lines can interleave ("...OKRANK 0...").
    ok = set(re.findall(r"RANK \d+ \w+ [\w-]+ OK", proc.stdout))
    names = (*STAGERS, "manager", "manager-reuse")
    want = {f"RANK {r} {mode} {name} OK" for r in (0, 1) for mode in ("thread", "process") for name in names}
    want -= {f"RANK {r} process manager-reuse OK" for r in (0, 1)}  # refused in PROCESS mode
    assert want <= ok, sorted(want - ok)
    for mode in ("thread", "process"):
        for name in STAGERS:
            assert (tmp_path / "vol" / f"{mode}-{name}" / ".metadata").is_file(), (mode, name)
