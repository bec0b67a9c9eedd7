"""Step-numbered checkpoints under one root: names, listing, and the newest published one."""

from __future__ import annotations

import re

from .layout import METADATA_NAME
from .volumes import Volume

_STEP_DIR = re.compile(r"^step_(\d+)/?$")


def checkpoint_name(step: int) -> str:
    """The location name of the checkpoint of ``step`` under a root: ``step_00000042``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def list_checkpoints(root: Volume) -> list[tuple[int, str, bool]]:
    """``(step, name, published)`` for every step location under ``root``, oldest first.

    ``published`` is true when the location's ``.metadata`` exists: the save finished.
    """
    out = []
    for name in root.list_files():
        match = _STEP_DIR.match(name)
        if match:
            child = name.rstrip("/")
            out.append((int(match.group(1)), child, root.child(child).size(METADATA_NAME) is not None))
    return sorted(out)


def latest_checkpoint(root: Volume) -> tuple[int, str] | None:
    """``(step, name)`` of the newest published checkpoint under ``root``, or ``None``."""
    for step, name, published in reversed(list_checkpoints(root)):
        if published:
            return step, name
    return None
