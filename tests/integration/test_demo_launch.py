"""How the demo starts its torchrun jobs (uc_checkpoint.demo.run.start_torchrun): a rank that dies
of SIGSEGV leaves its Python stack in a stderr file of its own in the work directory, and the
failure message names that file. A real torchrun job with a real segmentation fault."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from uc_checkpoint.demo.run import follow, job_logs, rank_log_dir, start_torchrun

RANK_SCRIPT = """
import ctypes
import os
import sys


def crash_in_teardown():
    ctypes.string_at(0)  # reads address 0: SIGSEGV


rank = int(os.environ["RANK"])
print(f"rank {rank} says hello", flush=True)
print(f"rank {rank} warns", file=sys.stderr, flush=True)
if rank == 1:
    crash_in_teardown()
"""


def test_a_rank_killed_by_sigsegv_leaves_its_stack_in_a_file_the_failure_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)  # the demo sets it, not the caller
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    job = start_torchrun("crash", tmp_path, 2, [str(script)])
    assert follow(job, time.time() + 240) == "failed"
    assert job.proc.returncode != 0

    message = job_logs(tmp_path, "crash")
    stderr_files = sorted(rank_log_dir(tmp_path, "crash").glob("*/attempt_0/*/stderr.log"))
    assert [p.parent.name for p in stderr_files] == ["0", "1"], stderr_files
    assert str(tmp_path / "log-crash.txt") in message and all(str(p) in message for p in stderr_files), message
    rank0, rank1 = (p.read_text() for p in stderr_files)
    assert "rank 0 warns" in rank0 and "Fatal Python error" not in rank0, rank0
    # faulthandler's report: the signal and the Python stack that took it.
    assert "rank 1 warns" in rank1 and "Fatal Python error: Segmentation fault" in rank1, rank1
    assert "crash_in_teardown" in rank1, rank1
    assert "rank 1 says hello" in (stderr_files[1].parent / "stdout.log").read_text()
    # Still in torchrun's own log too (teed), where the demo always kept the job's output.
    assert "Segmentation fault" in (tmp_path / "log-crash.txt").read_text(errors="replace")
