"""``uc-checkpoint inspect`` on the data-pipeline state: the exactly-once digest checked so far, a
tampered state caught, a state without a digest reported as not checkable (the installed console
script, a real process)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from uc_checkpoint.data.tracker import DataTracker, ShardSpec
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops.manager import CheckpointManager

SHARDS = [ShardSpec(f"part-{i:03d}.jsonl", 40, f"size={1000 + i},mtime_ns=7") for i in range(4)]


def inspect(path: Path, *extra: str) -> subprocess.CompletedProcess:
    exe = shutil.which("uc-checkpoint", path=str(Path(sys.executable).parent))
    assert exe, "the uc-checkpoint console script is not installed in the venv"
    return subprocess.run([exe, "inspect", str(path), *extra], capture_output=True, text=True, timeout=300)


def saved_state(**kw) -> dict:
    tracker = DataTracker(SHARDS, seed=1, num_workers=2, shuffle_within_shard=True, **kw)
    tracker.record(0, 50)
    tracker.record(1, 30)
    return tracker.global_state([tracker.local_state()])


def test_inspect_checks_the_digest_so_far(tmp_path: Path, staging: Path) -> None:
    good = saved_state()
    tampered = json.loads(json.dumps(good))
    shard, start, end = tampered["remaining"][0]
    tampered["remaining"][0] = [shard, start - 1, end - 1]  # one sample read twice, one never
    states = {10: good, 20: tampered, 30: saved_state(exactly_once="off")}
    manager = CheckpointManager(str(tmp_path / "run"), keep_last=None, staging=Staging(mode="sync"))
    for step, state in states.items():
        manager.save(step, {"model": {"w": torch.zeros(4)}, "data": {"global_state": json.dumps(state)}})

    info = json.loads(inspect(tmp_path / "run" / "step_00000010", "--json").stdout)
    (st,) = info["data_pipeline"].values()
    assert st["shuffle_within_shard"] is True and st["samples_consumed_in_epoch"] == 80
    assert st["exactly_once"] == {
        "samples_covered": 80,
        "shards_complete": 1,  # the first shard; the others partly
        "shards": 4,
        "checks_out": True,
        "problem": None,
    }
    text = inspect(tmp_path / "run" / "step_00000010").stdout
    assert "shuffled within shards" in text and "80 samples covered, 1 of 4 shards complete; checks out so far" in text

    bad = inspect(tmp_path / "run" / "step_00000020")
    assert bad.returncode == 0, bad.stderr
    assert "DOES NOT check out" in bad.stdout and "k >= 1 skipped and as many repeated" in bad.stdout, bad.stdout

    off = inspect(tmp_path / "run" / "step_00000030").stdout
    assert "exactly-once digest: not checkable: no digest" in off
