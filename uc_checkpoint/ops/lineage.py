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

:func:`mark_rollback` is what the manager's first save runs (on rank 0); everything else here
but :func:`abandonment_marker` / :func:`marker_applies` is a pure function.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from uc_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, TransferError
from uc_checkpoint.format.layout import ABANDONED_NAME, checkpoint_name
from uc_checkpoint.ops.retention import steps_to_delete

if TYPE_CHECKING:
    from uc_checkpoint.ops.catalog import CheckpointInfo
    from uc_checkpoint.volumes import Volume

logger = logging.getLogger(__name__)


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
    if ABANDONED_NAME not in files:
        return None
    raw = location.read_bytes(ABANDONED_NAME)
    return describe_marker(raw) if marker_applies(raw, manifest) else None


def newer_published(published: Sequence[int], step: int) -> list[int]:
    """The published steps above ``step``: what a save of ``step`` abandons."""
    return sorted(s for s in published if s > step)


def mark_rollback(
    root: Volume,
    step: int,
    resumed: int | None,
    *,
    infos: Iterable[CheckpointInfo],
    is_published: Callable[[CheckpointInfo], bool],
    read_manifest: Callable[[Volume], Mapping[str, Any] | None],
    abandoned: set[int],
    log: logging.Logger = logger,
) -> list[int]:
    """Before a run's first save of ``step`` under ``root``: mark the published steps above it as
    abandoned, and take back ``resumed`` (the step the run loaded, None if none) if a rollback had
    abandoned it. Returns the steps marked now, with a warning naming them.

    Args:
        infos: the root's listing (``published`` looked up or not).
        is_published: whether a listed location is published (asked only for steps above ``step``).
        read_manifest: the manifest of the checkpoint at a location (``.metadata`` read, retried);
            CorruptCheckpointError or CheckpointNotFoundError skip that checkpoint (``latest()``
            skips it anyway).
        abandoned: the steps known to be abandoned, updated in place: ``step`` and ``resumed``
            leave it, every published step above ``step`` joins it.
        log: where the warnings go (the manager passes its own logger).

    A marker already there that applies is left as it is (some mounts refuse rewrites); a mount
    that refuses to delete the resumed step's marker is logged, not raised (newer saves win anyway).

    Raises:
        TransferError / VolumeError: a marker cannot be looked up, read or written.
    """
    abandoned.discard(step)  # saved again now, on this line
    if resumed is not None:
        abandoned.discard(resumed)
        location = root.child(checkpoint_name(resumed))
        if location.size(ABANDONED_NAME) is not None:
            try:
                location.delete(ABANDONED_NAME)
            except TransferError as exc:  # a mount that refuses deletes: newer saves win anyway
                log.warning("checkpoint manager: could not take back step %d (%s)", resumed, exc)
            else:
                log.warning(
                    "checkpoint manager: step %d, abandoned by an earlier rollback, was loaded and "
                    "is saved from: it is part of the run's line again",
                    resumed,
                )
    newer = newer_published([i.step for i in infos if i.step > step and is_published(i)], step)
    marked = []
    for old in newer:
        if old == resumed:
            continue
        location = root.child(checkpoint_name(old))
        try:
            manifest = read_manifest(location)
        except (CorruptCheckpointError, CheckpointNotFoundError):
            continue  # broken or gone: latest() skips it anyway
        abandoned.add(old)
        if abandonment_of(location, manifest, location.list_files()) is not None:
            continue  # an earlier rollback's marker still says so (and some mounts refuse rewrites)
        location.publish_bytes(
            ABANDONED_NAME, abandonment_marker((manifest or {}).get("save_id"), step, resumed), overwrite=True
        )
        marked.append(old)
    if marked:
        log.warning(
            "checkpoint manager: saving step %d under %s, below published step(s) %s: treating this as a "
            "rollback. Those checkpoints are now an abandoned branch (a %s file in each): latest() skips "
            "them and retention deletes them first. To return to one, load it with load(state, step=N) "
            "and save from it.",
            step,
            root.url,
            marked,
            ABANDONED_NAME,
        )
    return marked


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
    "mark_rollback",
    "marker_applies",
    "newer_published",
    "parse_marker",
    "retention_plan",
]
