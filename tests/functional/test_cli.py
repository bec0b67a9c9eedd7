"""The ``uc-checkpoint`` verbs on real checkpoints, on a local path and on the local S3 server, run as
a user runs them (the installed console script, a real process): ls, inspect, verify, gc; --json;
one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from uc_checkpoint.data.loading import TrackerStateful
from uc_checkpoint.data.tracker import DataTracker, ShardSpec
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops.manager import CheckpointManager

SHARDS = [ShardSpec(f"part-{i:03d}.jsonl", 50) for i in range(6)]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("uc-checkpoint", path=str(Path(sys.executable).parent))
    assert exe, "the uc-checkpoint console script is not installed in the venv"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def make_root(root: str) -> DataTracker:
    """Two published checkpoints (model + AdamW-like state + data-pipeline state) and one save
    that never published, under ``root``."""
    tracker = DataTracker(SHARDS, seed=7)
    tracker.start_epoch(0)
    manager = CheckpointManager(root, keep_last=None, staging=Staging(mode="sync"))
    for step in (10, 20):
        tracker.record(0, 30)
        sd = {
            "model": {"w": torch.full((64, 32), float(step)), "b": torch.zeros(32, dtype=torch.bfloat16)},
            "optim": {"step": step, "exp_avg": torch.ones(64, 32)},
            "data": TrackerStateful(tracker),
        }
        manager.save(step, sd)
    return tracker


def test_ls_inspect_verify_on_a_local_root(tmp_path: Path, staging: Path) -> None:
    root = tmp_path / "run"
    make_root(str(root))
    # An unpublished location (a save that died) and a damaged checkpoint.
    (root / "step_00000030").mkdir()
    (root / "step_00000030" / "__0_deadbeef_0.distcp").write_bytes(b"x" * 10)

    out = cli("ls", str(root))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # The newest published checkpoint is checked (what a resume loads); the older one only listed.
    assert lines[1].split()[:2] == ["10", "published"], out.stdout
    assert lines[2].split()[:2] == ["20", "complete"], out.stdout
    assert lines[3].split()[:2] == ["30", "incomplete"], out.stdout
    assert "1 checkpoint 'published'" in lines[4] and "--check all" in lines[4], out.stdout
    rows = json.loads(cli("ls", str(root), "--json", "--check", "all").stdout)
    assert [(r["step"], r["state"]) for r in rows] == [(10, "complete"), (20, "complete"), (30, "incomplete")]
    assert rows[0]["files"] >= 1 and rows[0]["bytes"] > 64 * 32 * 4
    listed = json.loads(cli("ls", str(root), "--json", "--check", "none").stdout)
    assert [(r["step"], r["state"]) for r in listed] == [(10, "published"), (20, "published"), (30, "incomplete")]
    # Nothing but the claim lies beside these checkpoints: the listing's sizes are the checked ones.
    assert [(r["bytes"], r["files"]) for r in listed] == [(r["bytes"], r["files"]) for r in rows]

    info = json.loads(cli("inspect", str(root / "step_00000020"), "--json").stdout)
    items = {i["key"]: i for i in info["items"]}
    assert items["model.w"]["shape"] == [64, 32] and items["model.w"]["dtype"] == "float32"
    assert items["model.w"]["bytes"] == 64 * 32 * 4
    assert items["model.b"]["dtype"] == "bfloat16"
    assert info["files"]["0"] and info["saved_by"]["pid"] > 0
    (state,) = info["data_pipeline"].values()
    assert state["epoch"] == 0 and state["samples_consumed_in_epoch"] == 60
    assert state["samples_remaining_in_epoch"] == 300 - 60 and state["num_shards"] == 6
    eo = state["exactly_once"]
    assert eo["checks_out"] is True and eo["samples_covered"] == 60 and eo["shards_complete"] == 1
    text = cli("inspect", str(root / "step_00000020")).stdout
    assert "model.w" in text and "60 samples consumed" in text
    assert "exactly-once digest: 60 samples covered, 1 of 6 shards complete; checks out so far" in text

    good = cli("verify", str(root / "step_00000010"), "-v")  # -v after the verb works too
    assert good.returncode == 0 and ": OK;" in good.stdout and " checksummed (" in good.stdout, (
        good.stdout + good.stderr
    )
    # Output cut short by the reader (`| head -1`) is not an error.
    exe = shutil.which("uc-checkpoint", path=str(Path(sys.executable).parent))
    piped = subprocess.run(
        ["bash", "-c", f"'{exe}' inspect '{root / 'step_00000020'}' | head -1; exit ${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert piped.returncode == 0 and "Broken pipe" not in piped.stderr, piped.stderr

    # A flipped byte in a data file: verify names it and exits 1; ls does not see it (sizes only).
    ckpt = root / "step_00000020"
    victim = sorted(ckpt.glob("*.distcp"))[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    bad = cli("verify", str(ckpt), "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    report = json.loads(bad.stdout)
    assert not report["ok"] and victim.name in report["problems"][0] and "checksum" in report["problems"][0]
    # A missing file: ls reports the checkpoint broken and names the file.
    victim.unlink()
    rows = json.loads(cli("ls", str(root), "--json").stdout)
    assert rows[1]["state"] == "broken" and victim.name in rows[1]["problem"]

    gc = cli("gc", str(root), "--grace-s", "0", "--no-staging", "--json")
    assert gc.returncode == 0, gc.stderr
    assert any("step_00000030" in f for f in json.loads(gc.stdout)["deleted_files"])


def test_verbs_on_s3(tmp_path: Path, staging: Path, s3_server: str, s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/runs/a"
    env = {"AWS_ENDPOINT_URL": s3_server}
    os.environ["AWS_ENDPOINT_URL"] = s3_server
    try:
        make_root(root)
    finally:
        del os.environ["AWS_ENDPOINT_URL"]
    rows = json.loads(cli("ls", root, "--json", env=env).stdout)
    assert [(r["step"], r["state"]) for r in rows] == [(10, "published"), (20, "complete")]
    rows = json.loads(cli("ls", root, "--json", "--check", "all", env=env).stdout)
    assert [(r["step"], r["state"]) for r in rows] == [(10, "complete"), (20, "complete")]
    info = json.loads(cli("inspect", f"{root}/step_00000010", "--json", env=env).stdout)
    assert {"model.w", "optim.exp_avg"} <= {i["key"] for i in info["items"]}
    ok = cli("verify", f"{root}/step_00000010", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr


#: Runs the CLI's main() with the arguments given, then reports on stderr (at exit, so also after
#: argparse's --help) which torch modules the process imported.
TORCH_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('torch modules:', sum(m.split('.')[0] == 'torch' for m in sys.modules), "
    "file=sys.stderr))\n"
    "from uc_checkpoint.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def torch_modules(*args: str) -> tuple[int, subprocess.CompletedProcess]:
    """``(torch modules imported, the process)`` of the CLI run with ``args`` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", TORCH_PROBE, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("torch modules: ")]
    return int(line.split(": ")[1]), proc


class _SystemCall:
    """Pickles as ``os.system(command)``: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def test_help_and_ls_start_without_torch(tmp_path: Path, staging: Path) -> None:
    """``--help`` and ``ls`` import no torch (it costs seconds): ``ls`` reads what each
    ``.metadata`` it checks references without torch, in every ``--check`` mode, and judges a
    broken or hostile one as the full decoder does."""
    root = tmp_path / "run"
    (root / "step_00000030").mkdir(parents=True)  # a save that died: no .metadata
    (root / "step_00000030" / "__0_deadbeef_0.distcp").write_bytes(b"x" * 10)
    for args in (["--help"], ["ls", "--help"], ["demo", "--help"], ["ls", str(root)], ["ls", str(tmp_path)]):
        n, proc = torch_modules(*args)
        assert n == 0, (args, proc.stdout)
    assert "incomplete" in torch_modules("ls", str(root))[1].stdout
    make_root(str(root))
    n, proc = torch_modules("ls", str(root), "--check", "none")
    assert n == 0 and proc.stdout.count(" published ") == 2, proc.stdout
    n, proc = torch_modules("ls", str(root))
    assert n == 0 and " complete " in proc.stdout and proc.stdout.count(" published ") == 1, proc.stdout
    n, proc = torch_modules("ls", str(root), "--check", "all")
    assert n == 0 and proc.stdout.count(" complete ") == 2, proc.stdout
    # The probe can tell: inspect decodes a .metadata in full, which needs torch.
    n, proc = torch_modules("inspect", str(root / "step_00000020"), "--no-data-state")
    assert n > 0 and "model.w" in proc.stdout, proc.stdout

    # Broken checkpoints: a newer one whose .metadata runs code (it must not run), one with a
    # missing data file, one whose .metadata is garbage. Still no torch, and the problems named.
    marker = tmp_path / "pwned"
    hostile = root / "step_00000040"
    shutil.copytree(root / "step_00000020", hostile)
    (hostile / ".metadata").write_bytes(pickle.dumps(_SystemCall(f"touch '{marker}'")))
    garbage = root / "step_00000035"
    shutil.copytree(root / "step_00000020", garbage)
    (garbage / ".metadata").write_bytes(b"not a pickle")
    missing = sorted((root / "step_00000020").glob("*.distcp"))[0]
    missing.unlink()
    for check in ("latest", "all"):
        n, proc = torch_modules("ls", str(root), "--json", "--check", check)
        assert n == 0, proc.stdout
        rows = {r["step"]: r for r in json.loads(proc.stdout)}
        refused = f"refusing to unpickle {os.system.__module__}.system"
        assert rows[40]["state"] == "broken" and refused in rows[40]["problem"], rows
        assert rows[35]["state"] == "broken" and "corrupt or truncated" in rows[35]["problem"], rows
        assert rows[20]["state"] == "broken" and f"{missing} is missing" in rows[20]["problem"], rows
        assert rows[10]["state"] == "complete", rows
    assert not marker.exists(), "the .metadata's payload ran"
    n, proc = torch_modules("ls", str(root))
    assert n == 0 and "problem: " in proc.stdout and f"{os.system.__module__}.system" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["ls", "/no/such/root"], "does not exist"),
        (["inspect", "/no/such/ckpt"], "/no/such/ckpt"),
        (["verify", "/no/such/ckpt"], "/no/such/ckpt"),
        (["gc", "/tmp", "--grace-s", "-1"], "grace_s"),
        (["inspect", "foo://bucket/x"], "foo"),
        (["ls", "/tmp", "--bogus"], "--bogus"),
    ],
)
def test_user_mistakes_are_one_line(args: list[str], needle: str) -> None:
    out = cli(*args)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr and not out.stdout, (out.stdout, out.stderr)
    assert needle in out.stderr, out.stderr
    assert len([line for line in out.stderr.splitlines() if line.strip()]) <= 2, (
        out.stderr
    )  # argparse adds its usage line
