"""How an async save passes from the caller's thread to DCP's save thread, and how its failure is
reported when nobody reads its future.

``dcp.async_save`` calls the writer's ``stage()`` on the caller's thread, then runs the save's hooks
(``reset``, ``storage_meta``, ``set_up_storage_writer``, ...) on a thread of its own. What the save
needs from its staging (where the caller's writer pointed, the world size, the lease of kept
staging buffers) is a :class:`StagedSave`, left in the writer's :class:`Handover`: one slot per
writer object. The save's thread takes it at its first hook. In THREAD mode that thread is DCP's
executor thread, told apart by its name (:data:`~uc_checkpoint.dcp.compat.DCP_ASYNC_THREAD_PREFIX`),
so a synchronous save or a ``reset`` on any other thread never takes another save's staging. In
PROCESS mode DCP pickles the writer on its executor thread for the checkpoint process: the staged
save goes there with it (:meth:`Handover.take_for_pickle`).

One writer object may serve overlapping async saves: a second ``stage()`` waits (on a condition,
milliseconds) until DCP's thread of the first has taken its staging. A staging that no thread takes
(DCP failed after ``stage()``) is dropped by the next one, at once when no DCP save thread is alive.

Nothing here reads a stack frame and nothing sleeps to hand the GIL over: the state crosses threads
in these named objects. The interpreter's exit needs no hook either: the save's threads are DCP's
executor thread, which Python joins at exit, and :class:`~uc_checkpoint.volumes.workers.Workers`,
which keep taking work meanwhile.

A failed async save's error is on the future ``async_save`` returned, which scripts often drop.
:class:`BackgroundSave` logs it at ERROR when one of the writer's hooks sees it, and, for a save DCP
stopped between the writer's hooks (its planner or another rank failed), when its thread is found
to have ended without the save ending: at the writer's next ``stage()`` or at interpreter exit
(:data:`BACKGROUND`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from uc_checkpoint.dcp import compat as dcp_compat
from uc_checkpoint.dcp.buffers import BufferLease
from uc_checkpoint.errors import StagingError
from uc_checkpoint.volumes import Volume

logger = logging.getLogger(__name__)

#: Seconds a ``stage()`` waits for DCP's thread of the previous async save of the same writer to
#: take its staging (milliseconds normally) before dropping it as never started.
UNTAKEN_WAIT_S = 5.0


def on_dcp_save_thread() -> bool:
    """Whether the calling thread is one DCP made to run a THREAD-mode ``dcp.async_save``."""
    return threading.current_thread().name.startswith(dcp_compat.DCP_ASYNC_THREAD_PREFIX)


def _dcp_save_threads_alive() -> bool:
    me = threading.current_thread()
    prefix = dcp_compat.DCP_ASYNC_THREAD_PREFIX
    return any(t is not me and t.is_alive() and t.name.startswith(prefix) for t in threading.enumerate())


class BackgroundSave:
    """One async save as its error report sees it: bound to the thread that runs it, ended with
    or without an error.

    Args:
        what: the save's location (path or URL), for messages.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._ended = False
        self._lock = threading.Lock()

    def bind(self, what: str | None = None) -> None:
        """The calling thread runs this save from now on."""
        self.thread = threading.current_thread()
        if what:
            self.what = what
        BACKGROUND.add(self)

    def end(self, error: BaseException | None = None) -> None:
        """This rank's part of the save is over; ``error`` (why it failed) is logged at ERROR."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self.error = error
        if error is not None:
            logger.error(
                "checkpoint save to %s failed in the background: %s: %s", self.what, type(error).__name__, error
            )

    @property
    def ended(self) -> bool:
        return self._ended

    def stopped_unseen(self) -> bool:
        """End the save if its thread is gone without ending it (DCP stopped it between the writer's
        hooks), logging that; return whether it did."""
        thread = self.thread
        if thread is None or thread.is_alive() or self._ended:
            return False
        with self._lock:
            if self._ended:
                return False
            self._ended = True
        logger.error(
            "checkpoint save to %s failed in the background: DCP stopped it between the writer's steps "
            "(its error is on the future dcp.async_save returned); nothing was published",
            self.what,
        )
        return True


class BackgroundSaves:
    """The async saves of this process not yet ended, weakly held: :meth:`report` logs those DCP
    stopped unseen. Registered with :mod:`atexit` at first use, which runs after Python has joined
    DCP's save threads. One per process (:data:`BACKGROUND`): there is one interpreter exit."""

    def __init__(self) -> None:
        self._saves: weakref.WeakSet[BackgroundSave] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._registered = False

    def add(self, save: BackgroundSave) -> None:
        with self._lock:
            if not self._registered:
                atexit.register(self.report)
                self._registered = True
            self._saves.add(save)

    def report(self) -> None:
        """Log every save DCP stopped unseen, and forget the ended ones."""
        with self._lock:
            saves = list(self._saves)
        for save in saves:
            save.stopped_unseen()
        with self._lock:
            for save in saves:
                if save.ended:
                    self._saves.discard(save)


#: This process's async saves in flight (see :class:`BackgroundSaves`).
BACKGROUND = BackgroundSaves()


@dataclass
class StagedSave:
    """An async save between ``stage()`` and its thread's first hook.

    Attributes:
        location: where the caller's writer pointed when ``async_save`` was called (its thread's
            last ``reset(checkpoint_id)``, else the writer's path); a ``checkpoint_id`` given to
            ``async_save`` replaces it in the save's ``reset``.
        world_size: the process group's size at staging (None without one).
        staged_by: the thread that called ``stage()``.
        lease: the kept staging buffers the snapshot was copied into, or None.
        report: the save's :class:`BackgroundSave`.
    """

    location: str | Volume
    world_size: int | None
    staged_by: threading.Thread
    lease: BufferLease | None
    report: BackgroundSave = field(init=False)

    def __post_init__(self) -> None:
        self.report = BackgroundSave(str(self.location))

    def drop(self, why: str) -> None:
        """No thread will run this save: end it. Its buffers are not given back (a thread that is
        only slow may still read them)."""
        if self.lease is not None:
            self.lease.forget()
        self.report.end(StagingError(f"an async save staged for {self.location} never reached the writer ({why})"))


class Handover:
    """The writer's one slot for an async save's :class:`StagedSave` (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._staged: StagedSave | None = None

    def put(self, staged: StagedSave, wait_s: float = UNTAKEN_WAIT_S) -> None:
        """Leave ``staged`` for its save's thread. A staging still there is waited for while a
        DCP save thread is alive (that one is about to take it), at most ``wait_s`` seconds, then
        dropped."""
        with self._cond:
            deadline = time.monotonic() + wait_s
            while self._staged is not None and _dcp_save_threads_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))  # woken by take(); also notices a thread that died
            if self._staged is not None:
                self._staged.drop("DCP failed before it")
            self._staged = staged

    def take(self) -> StagedSave | None:
        """The staging of the async save the calling thread runs: taken on DCP's save thread only,
        None on any other thread or with nothing staged."""
        if not on_dcp_save_thread():
            return None
        with self._cond:
            staged, self._staged = self._staged, None
            self._cond.notify_all()
        if staged is not None:
            staged.report.bind()
        return staged

    def take_for_pickle(self) -> StagedSave | None:
        """The staging the writer's pickle carries to DCP's checkpoint process (PROCESS mode, whose
        executor thread pickles the writer): taken by any thread but the one that staged it (a copy
        made there takes nothing), and ended here, its buffers going with the snapshot."""
        with self._cond:
            staged = self._staged
            if staged is None or staged.staged_by is threading.current_thread():
                return None
            self._staged = None
            self._cond.notify_all()
        if staged.lease is not None:
            staged.lease.forget()
        staged.report.end()
        return staged

    @property
    def staged(self) -> StagedSave | None:
        """The staging waiting in the slot (None: none)."""
        return self._staged

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


__all__ = ["BACKGROUND", "UNTAKEN_WAIT_S", "BackgroundSave", "BackgroundSaves", "Handover", "StagedSave"]
