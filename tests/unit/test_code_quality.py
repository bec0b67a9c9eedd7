"""The code stays linted, formatted and type-checked: ruff (pyflakes, pycodestyle, import order,
bugbear, pyupgrade; ``pyproject.toml``'s ``[tool.ruff]``), ``ruff format``, and mypy over the package
(``[tool.mypy]``). Run here so that the one test command checks them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SOURCES = ["uc_checkpoint", "tests", "benchmarks", "scripts"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, timeout=600)


def test_ruff_lint() -> None:
    proc = _run("ruff", "check", "--no-cache", *SOURCES)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format() -> None:
    proc = _run("ruff", "format", "--check", "--no-cache", *SOURCES)
    assert proc.returncode == 0, "run `.venv/bin/ruff format`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]


def test_mypy() -> None:
    cache = Path(REPO) / ".mypy_cache"
    proc = _run("mypy", "--cache-dir", str(cache))
    if "No module named mypy" in proc.stderr:
        pytest.fail("mypy is not installed: ./scripts/setup.sh installs the test extra")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
