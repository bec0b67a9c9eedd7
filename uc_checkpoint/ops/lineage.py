"""A run's lineage under one root: rollbacks, abandoned branches, and which checkpoints to keep.

Steps only grow within one run, so "newest" usually means "highest step". A rollback breaks that:
the user loads step 100 of a run that reached step 200 (after a loss spike, say) and trains on,
saving 110, 120, ... Ranking by step would keep resuming and keeping 200, the branch the user
left. So the first save of a :class:`~uc_checkpoint.ops.manager.CheckpointManager` that is *below* a
published step marks every published step above it as **abandoned**: a small JSON file,
:data:`~uc_checkpoint.format.layout.ABANDONED_NAME`, in each such checkpoint's location, naming the
``save_id`` of the checkpoint it applies to (a later save that replaces that checkpoint makes the
marker stale; the writer also deletes it then). ``latest()`` skips abandoned checkpoints, and
retention counts them as older than every checkpoint of the run's current line.

The marker lives in the checkpoint's own location, so finding it costs nothing extra: ``latest()``
lists the location it is about to pick anyway. No file shared between runs is ever rewritten (some
mounts cannot replace files). Loading an abandoned step explicitly and saving from it takes it back
(its marker is removed): a rollback can itself be rolled back.

Everything here but :func:`abandonment_marker` / :func:`marker_applies` is a pure function.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from uc_checkpoint.ops.retention import steps_to_delete


def abandonment_marker(save_id: str | None, abandoned_by_step: int, resumed_from: int | None) -> bytes:
    """The content of an abandonment marker (JSON, bytes): which checkpoint it applies to
    (``save_id`` from its manifest; None for a checkpoint without one, where the marker applies to
    whatever is published there), the step whose save abandoned it, the step that run had resumed
    from (None when unknown), and who wrote it (host, pid, Unix time)."""
    body = {
        "save_id": save_id,
        "abandoned_by_step": abandoned_by_step,
        "resumed_from": resumed_from,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
    }
    return (json.dumps(body) + "\n").encode()


def parse_marker(raw: bytes | None) -> dict[str, Any] | None:
    """A marker's fields, or None when there is none or it is not a JSON object (a damaged marker
    is ignored: it cannot say which checkpoint it was meant for)."""
    if not raw:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def marker_applies(raw: bytes | None, manifest: Mapping[str, Any] | None) -> bool:
    """Whether the marker ``raw`` abandons the checkpoint whose manifest is ``manifest`` (not a
    later checkpoint saved at the same location)."""
    body = parse_marker(raw)
    if body is None:
        return False
    wanted = body.get("save_id")
    return wanted is None or (manifest or {}).get("save_id") == wanted


def describe_marker(raw: bytes | None) -> str:
    """A marker in words, for logs and ``uc-checkpoint ls``."""
    body = parse_marker(raw) or {}
    by, resumed = body.get("abandoned_by_step"), body.get("resumed_from")
    origin = f" (the run had resumed from step {resumed})" if resumed is not None else ""
    return f"abandoned by a rollback: step {by} was saved below it{origin}"


def abandonment_of(location: Any, manifest: Mapping[str, Any] | None, files: Mapping[str, int]) -> str | None:
    """Why the checkpoint at ``location`` (a :class:`~uc_checkpoint.volumes.Volume`, whose listing is
    ``files``) is abandoned, in words, or None when no marker there applies to it (its manifest is
    ``manifest``). Reads the marker only when the listing shows one.

    Raises:
        TransferError / VolumeError: the marker cannot be read.
    """
    from uc_checkpoint.format.layout import ABANDONED_NAME

    if ABANDONED_NAME not in files:
        return None
    raw = location.read_bytes(ABANDONED_NAME)
    return describe_marker(raw) if marker_applies(raw, manifest) else None


def newer_published(published: Sequence[int], step: int) -> list[int]:
    """The published steps above ``step``: what a save of ``step`` abandons."""
    return sorted(s for s in published if s > step)


def retention_plan(
    published: Sequence[tuple[int, bool]],
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protect: Collection[int] = (),
) -> list[int]:
    """Steps to delete under a retention policy, oldest first.

    Args:
        published: ``(step, abandoned)`` of every published checkpoint.
        keep_last: how many of the newest to keep (None: keep all). "Newest" follows the run's
            lineage: every checkpoint of the current line is newer than every abandoned one, and
            within each group the higher step is newer.
        keep_every: also keep every step that is a multiple of this.
        protect: steps never deleted (the save just published, the one in flight).

    Only checkpoints older than the oldest of the ``keep_last`` newest are ever deleted.
    """
    # One policy, written once: this is the (step, abandoned) form of ops.retention's.
    return steps_to_delete(
        [step for step, _ in published],
        keep_last=keep_last,
        keep_every=keep_every,
        protect=protect,
        abandoned={step for step, abandoned in published if abandoned},
    )


__all__ = [
    "abandonment_marker",
    "describe_marker",
    "marker_applies",
    "newer_published",
    "parse_marker",
    "retention_plan",
]
