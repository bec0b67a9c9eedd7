"""The docs stay true to the code: docs/api.md is what scripts/api_docs.py generates from the
docstrings, and docs/quickstart.md's examples run as written (Python blocks, then the shell lines,
in one fresh directory)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_api_reference_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/api_docs.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr


def test_quickstart_runs_as_written(tmp_path: Path) -> None:
    text = (REPO / "docs" / "quickstart.md").read_text()
    env = {**os.environ, "PYTHONPATH": str(REPO), "UC_CHECKPOINT_STAGING_DIR": str(tmp_path / "staging")}
    python_blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(python_blocks) >= 2
    for block in python_blocks:
        proc = subprocess.run(
            [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
        )
        assert proc.returncode == 0, f"{block}\n---\n{proc.stderr[-3000:]}"
    exe_dir = str(Path(sys.executable).parent)
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if not line.startswith("uc-checkpoint "):
                continue  # install lines are the set-up script's job
            cmd = line.split()
            cmd[0] = shutil.which("uc-checkpoint", path=exe_dir) or cmd[0]
            proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
            assert proc.returncode == 0, f"{line}\n---\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            assert "Traceback" not in proc.stderr
