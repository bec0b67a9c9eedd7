"""A tmpfs mounted for one test: a small disk whose ENOSPC comes from the kernel (needs root)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount``'s form: ``"40m"``) at ``mnt`` (created), yield it,
    then unmount it; skips the test where mounting is refused (not root)."""
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
