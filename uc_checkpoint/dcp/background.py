"""The report of an async save that fails where nobody looks.

A failed async save's error is on the future ``dcp.async_save`` returned, which scripts often drop.
:class:`BackgroundSave` logs it at ERROR when one of the writer's hooks sees it, and, for a save DCP
stopped between the writer's hooks (its planner or another rank failed), when its thread is found
to have ended without the save ending: at the next ``stage()`` of any writer, when the writer is
asked for its next save, or at interpreter exit (:data:`BACKGROUND`, registered with
:mod:`atexit`, which runs after Python has joined DCP's save threads).

Nothing here reads a stack frame or sleeps: the save's thread is the one that ran its first hook
(:meth:`BackgroundSave.bind`). The interpreter's exit needs no other hook: a save's threads are
DCP's executor thread, which Python joins at exit, and
:class:`~uc_checkpoint.volumes.workers.Workers`, which keep taking work meanwhile.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

logger = logging.getLogger(__name__)


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


__all__ = ["BACKGROUND", "BackgroundSave", "BackgroundSaves"]
