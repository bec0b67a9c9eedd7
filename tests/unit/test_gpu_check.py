"""benchmarks/gpu_check.py's logic, on CPU with a tiny state: every method saves through
UCVolumeWriter and loads back bit-exact, the table and the JSON carry every figure, and a machine
without CUDA (or without torch) gets exit code 2 and one line saying why."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_check
from tests.conftest import REPO

FIGURES = ("blocked_s", "staged_s", "published_s")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return {**env, "PYTHONPATH": str(REPO)}


@contextmanager
def _cli_logging_undone() -> Iterator[None]:
    """main() sets up logging as a command does (root handler, uc_checkpoint's level): undo it for
    the tests that run after this one in the same process."""
    root, ours = logging.getLogger(), logging.getLogger("uc_checkpoint")
    handlers, level = list(root.handlers), ours.level
    try:
        yield
    finally:
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
        ours.setLevel(level)


def test_cpu_mode_saves_every_method_and_loads_it_back_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "results" / "gpu_check.json"
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--size-gib", "0.004"]
    cmd += ["--repeats", "2", "--dir", str(work), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]

    lines = proc.stdout.strip().splitlines()
    results = json.loads(lines[-1])
    assert results["complete"] is True and results["ok"] is True and results["hung"] is False
    assert results["skipped"] == [] and results["warm_up_error"] is None
    assert list(results["methods"]) == list(gpu_check.METHODS)
    for name, row in results["methods"].items():
        assert row["error"] is None, name
        assert row["bit_exact"] is True and row["mismatch"] is None, name
        assert row["repeats_done"] == 2 and len(row["repeats"]) == 2, name
        for key in FIGURES:
            assert row["first"][key] > 0 and row[key] > 0, (name, key)
        # the save is published after its copy is complete, which is not before async_save returns
        assert row["first"]["blocked_s"] <= row["first"]["staged_s"] <= row["first"]["published_s"], name
        assert row["load_s"] > 0, name
    assert results["env"]["torch"] == torch.__version__ and results["env"]["device"] == "cpu"
    st = results["state"]
    assert st["on_device"] == st["tensors"] > 0
    assert set(st["bytes_by_dtype"]) == {"torch.bfloat16", "torch.float32"}
    assert sum(st["bytes_by_dtype"].values()) == st["bytes"]
    # on CPU DCP refuses pinned memory and non-blocking copies: the options say what ran
    assert results["settings"]["dcp_pinned_options"]["use_pinned_memory"] is False

    table = "\n".join(lines[:-1])
    assert "| method | stager |" in table
    for name in gpu_check.METHODS:
        row_line = next(line for line in lines if line.startswith(f"| {name} |"))
        assert row_line.rstrip().endswith("| yes |"), row_line

    written = json.loads(out.read_text())
    assert written.pop("table") == table
    assert written == results
    assert list(work.iterdir()) == []  # the work directory under --dir is removed


def test_a_spent_budget_skips_rounds_and_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--device", "cpu", "--size-gib", "0.004", "--repeats", "2", "--budget-s", "0", "--dir", str(tmp_path)]
    with _cli_logging_undone():
        assert gpu_check.main(argv) == 1
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["ok"] is False
    assert any(s.startswith("round 1 ") for s in results["skipped"])
    assert all(r["bit_exact"] is None for r in results["methods"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_asked_without_cuda_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--device", "cuda", "--dir", str(tmp_path)]) == gpu_check.EXIT_CANNOT_START
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("gpu_check: --device cuda, but CUDA is not available")
    assert list(tmp_path.iterdir()) == []  # nothing was started


def test_without_torch_it_exits_2_naming_torch(tmp_path: Path) -> None:
    code = (
        "import runpy, sys; sys.modules['torch'] = None; "  # import torch now raises ImportError
        "runpy.run_module('benchmarks.gpu_check', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "--device", "cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert proc.returncode == gpu_check.EXIT_CANNOT_START, proc.stderr
    assert proc.stderr.startswith("gpu_check: torch is missing")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_first_difference_names_the_first_changed_value() -> None:
    sd: dict[str, Any] = {
        "model": {"w": torch.arange(8, dtype=torch.bfloat16)},
        "optim": {"m": torch.ones(4)},
        "step": 3,
    }
    same = {"model": {"w": sd["model"]["w"].clone()}, "optim": {"m": torch.ones(4)}, "step": 3}
    assert gpu_check.first_difference(sd, same) is None

    one_element = {**same, "optim": {"m": torch.tensor([1.0, 1.0, 1.0, 1.0 + 2**-20])}}
    assert gpu_check.first_difference(sd, one_element) == "optim.m"
    other_dtype = {**same, "model": {"w": sd["model"]["w"].float()}}
    assert gpu_check.first_difference(sd, other_dtype) == "model.w"
    assert gpu_check.first_difference(sd, {**same, "step": 4}) == "step"
    assert gpu_check.first_difference(sd, {"model": same["model"], "step": 3}) == "<root> (keys)"


def test_the_state_is_mixed_precision_and_each_step_changes_every_tensor() -> None:
    sd = gpu_check.build_state(4 << 20, torch.device("cpu"))
    assert {t.dtype for t in sd["model"].values()} == {torch.bfloat16}
    moments = next(iter(sd["optim"]["state"].values()))
    assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.float32
    before = gpu_check.zeros_like(sd)
    for dst, src in zip(gpu_check.state.tensors_of(before), gpu_check.state.tensors_of(sd)):
        dst.copy_(src)
    before["step"] = sd["step"]
    assert gpu_check.first_difference(sd, before) is None
    gpu_check.training_step(sd, 7)
    assert sd["step"] == 7
    changed = [
        not torch.equal(a, b) for a, b in zip(gpu_check.state.tensors_of(sd), gpu_check.state.tensors_of(before))
    ]
    assert all(changed)
