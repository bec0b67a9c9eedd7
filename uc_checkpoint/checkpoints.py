"""Step-numbered checkpoints under one root: names, listing, and the newest published one.

Kept for existing imports: the catalog of checkpoints is :mod:`uc_checkpoint.ops.catalog`, whose
:class:`~uc_checkpoint.ops.catalog.CheckpointInfo` records and ``latest()`` (newest *intact*
checkpoint) are what new code should use.
"""

from __future__ import annotations

from .ops import catalog
from .ops.catalog import checkpoint_name
from .volumes import Volume


def list_checkpoints(root: Volume) -> list[tuple[int, str, bool]]:
    """``(step, name, published)`` for every step location under ``root``, oldest first.

    ``published`` is true when the location's ``.metadata`` exists: the save finished.
    """
    return [(info.step, info.name, info.published) for info in catalog.list_steps(root)]


def latest_checkpoint(root: Volume) -> tuple[int, str] | None:
    """``(step, name)`` of the newest published checkpoint under ``root``, or ``None`` (it is not
    checked to be intact: :func:`uc_checkpoint.ops.catalog.latest` does that)."""
    found = catalog.latest(root, intact=False)
    return None if found is None else (found.step, found.name)


__all__ = ["checkpoint_name", "latest_checkpoint", "list_checkpoints"]
