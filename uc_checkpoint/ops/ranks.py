"""How the ranks of a :class:`~uc_checkpoint.ops.manager.CheckpointManager` agree: rank 0 decides,
every rank gets its answer or its error, on gloo groups of the manager's own (:class:`RankGroup`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from uc_checkpoint.errors import RemoteRankError, portable_error, rebuild_error

T = TypeVar("T")


class RankGroup:
    """The ranks a :class:`~uc_checkpoint.ops.manager.CheckpointManager` works with, and how they agree.

    The manager never issues a collective on the caller's ``process_group`` itself: the first time
    one is needed, every rank of the group creates two gloo groups over the same ranks, one for
    DCP's saves (:meth:`save_group`) and one for what the training thread agrees on
    (:meth:`agree_group`). Why two, and why not the caller's group: DCP runs a save's collectives
    (plan gather, result gather, metadata broadcast) in its background thread while the training
    thread goes on issuing collectives of its own. Two threads issuing collectives on one group
    pair them in whatever order each rank happens to reach them, which deadlocks as soon as the
    ranks' orders differ. Background work gets a group nothing else uses; foreground agreement
    another. ``use_local_synchronization`` keeps ranks outside the group out of the call and leaves
    the default group's counter of group names alone, so the caller's own ``new_group`` calls stay
    in step on every rank.
    """

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self._pair: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # (save, agree)

    def distributed(self) -> bool:
        """Whether more than one rank takes part (else every call is local)."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def is_leader(self) -> bool:
        """Rank 0 of the group, or the only process."""
        return not self.distributed() or dist.get_rank(self.process_group) == 0

    def _groups(self, index: int) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if not self.distributed():
            return self.process_group
        if self._pair is None:
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            self._pair = (
                dist.new_group(ranks, backend="gloo", use_local_synchronization=True, group_desc="uc_checkpoint_save"),
                dist.new_group(ranks, backend="gloo", use_local_synchronization=True, group_desc="uc_checkpoint_agree"),
            )
        return self._pair[index]

    def save_group(self) -> dist.ProcessGroup | None:
        """Group for DCP's saves (collectives in a background thread); None without a process group."""
        return self._groups(0)

    def agree_group(self) -> dist.ProcessGroup | None:
        """Group for collectives the training thread issues (agreement, loads)."""
        return self._groups(1)

    def on_leader(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 of the group and hand its result, or its failure, to every rank
        (a collective on :meth:`agree_group`; ``what`` names the operation in messages).

        A failure is raised on every rank as the same class with the same message: rank 0 raises
        its own exception; the others rebuild it from its class name and message
        (:func:`uc_checkpoint.errors.portable_error`), with a :class:`RemoteRankError` naming rank 0
        and ``what`` as its cause. A class outside our hierarchy (and the builtin errors that can
        be rebuilt) is a :class:`RemoteRankError` on every rank, rank 0 included.
        """
        if not self.distributed():
            return fn()
        box: list[Any] = [None]
        error: Exception | None = None
        if self.is_leader():
            try:
                box[0] = ("ok", fn())
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                error = exc
                kind = type(exc).__qualname__
                kind = kind if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{kind}"
                box[0] = ("error", (portable_error(exc), kind, str(exc)))
        dist.broadcast_object_list(box, group=self.agree_group(), group_src=0)
        status, value = box[0]
        if status == "ok":
            return value
        portable, kind, message = value
        remote = RemoteRankError(f"rank 0 failed to {what}: {kind}: {message}", kind)
        if portable is None:
            raise remote from error
        if error is not None:
            raise error
        raise rebuild_error(*portable) from remote


__all__ = ["RankGroup"]
