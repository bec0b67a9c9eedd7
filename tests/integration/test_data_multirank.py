"""The data tracker across real torchrun ranks with real DataLoader workers: two ranks (2 workers
each) consume unevenly and checkpoint with UCVolumeWriter; a one-rank run with 3 workers resumes from
the checkpoint. Together they must read one whole epoch, each sample once; what the two ranks
consumed after the checkpoint (lost with the preempted run) is read again."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, torchrun

SCRIPT = SCRIPTS / "data_multirank.py"
SIZES = (40, 3, 57, 0, 21, 64, 9, 30, 17)  # as in the script


@pytest.mark.slow
def test_two_ranks_save_one_rank_resumes(tmp_path: Path, staging: Path) -> None:
    ckpt = tmp_path / "volume" / "step_1"
    out = tmp_path / "out"
    out.mkdir()
    saved = torchrun(SCRIPT, "save", str(ckpt), str(out), "2", nproc=2, timeout=900)
    assert saved.returncode == 0, (saved.stdout + saved.stderr)[-6000:]
    assert (ckpt / ".metadata").is_file()
    resumed = torchrun(SCRIPT, "resume", str(ckpt), str(out), "3", nproc=1, timeout=900)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]

    save = [json.loads((out / f"save-rank{r}.json").read_text()) for r in (0, 1)]
    resume = json.loads((out / "resume-rank0.json").read_text())
    before = Counter(tuple(p) for s in save for p in s["before"])
    after = [tuple(p) for s in save for p in s["after"]]
    seen = Counter(tuple(p) for p in resume["seen"])
    assert sum(before.values()) == 4 * (2 + 5)  # both ranks' progress is in the checkpoint
    assert before + seen == Counter((i, j) for i, n in enumerate(SIZES) for j in range(n))
    assert all(seen[p] == 1 for p in after)  # consumed after the checkpoint: read again
    assert resume["epoch_done"]
    summary = resume["summary"]
    assert summary["samples_consumed_in_epoch"] == 28
    assert summary["seeks"], summary  # resumed consumers start inside shards, not at their beginning
