"""How the ranks of a :class:`~uc_checkpoint.ops.manager.CheckpointManager` agree, all through one
object, :class:`RankGroup`: rank 0's result or error handed to every rank (:meth:`RankGroup.on_leader`,
a broadcast), whether a flag is set on any rank (:meth:`RankGroup.any_rank`, an all-reduce), both on
gloo groups of the manager's own, and rank 0's decision handed over the c10d store without a
collective (:meth:`RankGroup.decided`). A peer that stops answering fails each of them within the
job's timeout (:func:`hung_peer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from uc_checkpoint.dcp import compat
from uc_checkpoint.errors import PeerTimeoutError, RemoteRankError, portable_error, rank_error, rebuild_error

T = TypeVar("T")

#: What gloo and the c10d store say when a peer did not answer in time (torch 2.13: "Timed out
#: waiting 3000ms for recv operation to complete", "Application timeout caused pair closure",
#: "wait timeout after 3000ms, keys: ..."). Matched lowercase, in RuntimeErrors only.
_TIMEOUT_WORDS = ("timed out", "timeout")


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's or store wait's timeout (a torch ``RuntimeError``, its
    ``DistError`` subclasses included, whose message says so), itself or as the first failing
    rank's error in DCP's ``CheckpointException``."""
    for error in (exc, rank_error(exc)):
        if isinstance(error, RuntimeError) and any(w in str(error).lower() for w in _TIMEOUT_WORDS):
            return True
    return False


def hung_peer(what: str, peers: str, timeout: timedelta, cause: BaseException, waited_s: float) -> PeerTimeoutError:
    """The error of a rank whose ``peers`` (e.g. ``"rank 1"``) did not take part in ``what`` (the
    operation, e.g. ``"agree on preemption under s3://..."``) within ``timeout``; ``cause`` is
    torch's error, ``waited_s`` the seconds this rank waited."""
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return PeerTimeoutError(
        f"rank {me}: cannot {what}: {peers} did not take part within the timeout of "
        f"{timeout.total_seconds():g} s (waited {waited_s:.1f} s); it is hung, stopped or unreachable. "
        f"Exit and restart the job (nothing of an unfinished save is published). "
        f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    )


def describe_ranks(ranks: list[int]) -> str:
    """``"rank 3"`` or ``"one of ranks 1, 2, 3"`` (the first 8 named, then a count)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8]))
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"one of ranks {shown}{more}"


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

    Both groups are created with :meth:`timeout` (``new_group`` would give them torch's 30-minute
    gloo default whatever the job set), so every collective on them, DCP's in the save thread
    included, fails once a peer has not answered for that long. :meth:`collective` turns that
    failure into a :class:`~uc_checkpoint.errors.PeerTimeoutError` naming the operation and the
    peer; after one, the groups are unusable (gloo closes the pairs) and every later collective of
    this object raises at once.

    Decisions handed over the c10d store (:meth:`decided`) need no group: the training thread may
    take them while a save's collectives run, and a rank waits only for rank 0, never in a
    collective.

    Args:
        process_group: the caller's group (None: every rank).
        timeout: the longest wait for a peer; None: the default group's timeout (what
            ``init_process_group(timeout=...)`` set, the job's), read at first use. Not
            ``process_group``'s: a group made with ``new_group()`` has torch's default, not the
            job's.
        name: what tells this group's store keys from other groups' (the manager passes its root
            URL; see :meth:`store_key`).
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None, timeout: timedelta | None = None, *, name: str = ""
    ) -> None:
        self.process_group = process_group
        self.name = name
        self._timeout = timeout
        # The default group's store and this group's key prefix in it (store_key), set at first use.
        self._store: Any = None
        self._prefix: str | None = None
        self._pair: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # (save, agree)
        # The first peer timeout of these groups, raised again by every later collective.
        self._failure: PeerTimeoutError | None = None

    def distributed(self) -> bool:
        """Whether more than one rank takes part (else every call is local)."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def is_leader(self) -> bool:
        """Rank 0 of the group, or the only process."""
        return not self.distributed() or dist.get_rank(self.process_group) == 0

    def timeout(self) -> timedelta:
        """The longest wait for a peer in the manager's collectives and store waits: the one given,
        else the default group's (:func:`uc_checkpoint.dcp.compat.default_group_timeout`), read once.

        Raises:
            ValueError (torch's): no timeout was given and no process group is initialised.
        """
        if self._timeout is None:
            self._timeout = compat.default_group_timeout()
        return self._timeout

    def peers(self) -> list[int]:
        """The global ranks of the group other than this one."""
        me = dist.get_rank()
        return [r for r in dist.get_process_group_ranks(self.process_group or dist.group.WORLD) if r != me]

    def _groups(self, index: int) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if not self.distributed():
            return self.process_group
        if self._pair is None:
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            timeout = self.timeout()

            def create(desc: str) -> dist.ProcessGroup:
                return self.collective(
                    f"set up the checkpoint manager's {desc} group",
                    lambda: dist.new_group(
                        ranks,
                        timeout=timeout,
                        backend="gloo",
                        use_local_synchronization=True,
                        group_desc=f"uc_checkpoint_{desc}",
                    ),
                )

            self._pair = (create("save"), create("agree"))
        assert self._pair is not None
        return self._pair[index]

    def save_group(self) -> dist.ProcessGroup | None:
        """Group for DCP's saves (collectives in a background thread); None without a process group."""
        return self._groups(0)

    def agree_group(self) -> dist.ProcessGroup | None:
        """Group for collectives the training thread issues (agreement, loads)."""
        return self._groups(1)

    def collective(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``: collectives on this object's groups (DCP's ``load`` or ``save`` on one
        included), with a peer's timeout raised as :class:`PeerTimeoutError` (see
        :meth:`peer_timeout`; ``what`` names the operation). Other errors of ``fn`` pass as they are.

        Raises:
            PeerTimeoutError: a peer did not take part within :meth:`timeout`, now or in an earlier
                collective of these groups.
        """
        if self._failure is not None:
            raise PeerTimeoutError(f"cannot {what}: the ranks lost contact earlier: {self._failure}")
        started = time.monotonic()
        try:
            return fn()
        except BaseException as exc:
            error = self.peer_timeout(what, exc, time.monotonic() - started)
            if error is None:
                raise
            raise error from exc

    def peer_timeout(self, what: str, exc: BaseException, waited_s: float) -> PeerTimeoutError | None:
        """The :class:`PeerTimeoutError` of ``exc`` when it is a collective's timeout
        (:func:`timed_out`) on these groups, naming ``what`` and the peer (the other rank of a group
        of two); None for any other error. The first one is kept: every later :meth:`collective`
        raises it again (callable from any thread)."""
        if not (self.distributed() and timed_out(exc)):
            return None
        error = hung_peer(what, describe_ranks(self.peers()), self.timeout(), exc, waited_s)
        if self._failure is None:
            self._failure = error
        return error

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
        self.collective(what, lambda: dist.broadcast_object_list(box, group=self.agree_group(), group_src=0))
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

    def any_rank(self, what: str, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank of the group (a MAX all-reduce on
        :meth:`agree_group`; ``what`` names the operation in messages): every rank must call this
        at the same point, and every rank gets the same answer. Without a process group, ``flag``.

        Raises:
            PeerTimeoutError: a peer did not take part within :meth:`timeout`.
        """
        if not self.distributed():
            return flag
        box = torch.tensor([int(flag)])
        self.collective(what, lambda: dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.agree_group()))
        return bool(box.item())

    def store_key(self, key: str) -> str:
        """The c10d store key of this group's decision ``key`` (:meth:`decided`):
        ``uc_checkpoint/decided/<name>/<leader>/<serial>/<key>``, where ``<leader>`` is rank 0 of the
        group as a global rank and ``<serial>`` counts this rank's groups of that name and leader
        (their first :meth:`store_key`): ranks create their managers of a root in the same order, so
        the n-th group on every rank shares keys with the n-th one on the others. The counter is one
        store key per rank and name (``.../<leader>/groups/<rank>``), kept for the job.

        Raises:
            ValueError (torch's): the default process group is not initialised.
        """
        if self._prefix is None:
            self._store = compat.default_store()
            leader = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)[0]
            base = f"uc_checkpoint/decided/{self.name}/{leader}"
            serial = self._store.add(f"{base}/groups/{dist.get_rank()}", 1)
            self._prefix = f"{base}/{serial}"
        return f"{self._prefix}/{key}"

    def decided(self, what: str, key: str, make: Callable[[], bytes]) -> bytes:
        """``make()`` run on rank 0 of the group, and its bytes handed to every rank through the
        default group's c10d store (``set``/``wait``/``get``, requests to the store, not
        collectives: the training thread may call this while a save's collectives run in the
        background). Without a process group, ``make()``.

        Rank 0 sets the value under :meth:`store_key` and goes on; every other rank waits for it, at
        most :meth:`timeout`, reads it and counts itself as a reader (``add`` on a counter beside
        it); the last reader deletes the value and the counter, so a decision read by every rank
        leaves no key in the store.

        Args:
            what: the operation, named in a timeout's message (e.g. "receive the decision whether
                to save at step 5 for s3://...").
            key: the decision's name in this group: the same on every rank, used once.
            make: the decision (rank 0 only).

        Raises:
            PeerTimeoutError: (a rank other than 0) rank 0 did not decide within :meth:`timeout`:
                it is hung, stopped or unreachable. Nothing is recorded: the groups' collectives
                are untouched by a store's wait.
            Whatever ``make`` raises, on rank 0 (the others then wait for it until the timeout).
        """
        if not self.distributed():
            return make()
        full = self.store_key(key)
        store = self._store
        if self.is_leader():
            value = make()
            store.set(full, value)
            return value
        timeout = self.timeout()
        started = time.monotonic()
        try:
            store.wait([full], timeout)
            value = bytes(store.get(full))
        except RuntimeError as exc:
            if not timed_out(exc):
                raise
            leader = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)[0]
            raise hung_peer(what, f"rank {leader}", timeout, exc, time.monotonic() - started) from exc
        readers = dist.get_world_size(self.process_group) - 1
        if store.add(f"{full}/readers", 1) == readers:
            store.delete_key(full)
            store.delete_key(f"{full}/readers")
        return value


__all__ = ["RankGroup", "describe_ranks", "hung_peer", "timed_out"]
