"""Checkpoint saves in flight when the interpreter exits are finished before it shuts its thread pools.

At a normal exit Python first runs the callbacks registered with :mod:`threading`'s private
``_register_atexit`` (newest first), then joins non-daemon threads, and only then runs :mod:`atexit`.
:mod:`concurrent.futures` registers one of those callbacks: it marks every ``ThreadPoolExecutor`` as
shut down ("cannot schedule new futures after interpreter shutdown") and joins their workers. DCP's
async save runs in such a worker and keeps running, so a writer that does its I/O in that thread, as
stock ``FileSystemWriter`` does, still publishes. Ours hands files to thread pools (the upload pool,
boto3's transfer manager), which that callback would refuse, and the save would be lost without a
word. A callback registered after ``concurrent.futures`` was imported runs before its callback and
waits here for every save this process has in flight.

The registry is per process by nature (there is one interpreter exit), which is why it lives in this
module rather than in the writer or manager objects.

Nothing here reads another thread's stack: walking the ``f_back`` chain of a frame that another
thread is running is not memory-safe on CPython 3.11 (cpython#99110, #111363; seen here as
AttributeErrors on garbage, a spinning walk and segfaults with saves running in several threads of
one process). A save's thread records DCP's ``save`` frame from its own stack, and whether that
call still runs is asked of the frame object itself.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import Future
from types import FrameType
from typing import Any

from uc_checkpoint.dcp import compat as dcp_compat

logger = logging.getLogger(__name__)

#: Seconds to wait at exit for a save that was staged but whose background thread has not started
#: yet (it normally starts within milliseconds; DCP's PROCESS mode hands it off within seconds).
UNSTARTED_WAIT_S = 120.0


class SaveTicket:
    """One save in flight on this process, as the exit callback sees it.

    Opened when a save starts (``stage()`` for an async save, before its thread exists), bound to
    the thread that runs it, ended when this rank's part is over. A save whose call of DCP's
    ``save`` has returned, or whose thread has died, without ending its ticket (DCP failed between
    our hooks) counts as over.
    """

    def __init__(self, what: str, *, background: bool = False) -> None:
        #: The save's location (path or URL), for messages.
        self.what = what
        #: An async save: nobody may ever look at its future, so its failure is logged when it happens.
        self.background = background
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.opened = time.monotonic()
        self._ended = threading.Event()
        # DCP's ``save`` call on the bound thread (None: not found, or over). Dropped when the
        # ticket ends: a frame holds its locals, the state dict being saved among them.
        self._frame: FrameType | None = None
        self._frame_lock = threading.Lock()
        self._reported = False  # a failure found by :meth:`over` is logged once

    def bind(self, what: str | None = None) -> None:
        """The calling thread runs this save (called from inside DCP's ``save``, on its thread)."""
        self.thread = threading.current_thread()
        self._frame = _outermost_own_frame(dcp_compat.dcp_saver_file())
        if what:
            self.what = what

    def end(self, error: BaseException | None = None) -> None:
        """This rank's part of the save is over (``error``: why it failed). A background save's
        error is logged here; one DCP raised between the writer's steps, which ends no ticket, is
        logged when :meth:`over` first finds the save's call returned (the next save's start, or
        the interpreter's exit)."""
        if error is not None and self.error is None:
            self.error = error
            if self.background:
                logger.error(
                    "checkpoint save to %s failed in the background: %s: %s", self.what, type(error).__name__, error
                )
        self._frame = None
        self._ended.set()

    def over(self) -> bool:
        """Whether this rank's part of the save is over: ended, or its thread has left DCP's save.

        The explicit end is not enough: when another rank fails, DCP raises between our hooks and
        none of them runs again. A thread may outlive its save (a pool worker, or the main thread
        itself, which runs the exit callback), so what counts is whether the thread is still inside
        DCP's ``save``."""
        if self._ended.is_set():
            return True
        thread = self.thread
        if thread is None:
            # Staged, not yet started: DCP's THREAD executor starts its worker (named with this
            # prefix) inside async_save, before it returns. Without one, nothing will run this save
            # here (stage() called alone, or PROCESS mode, whose own executor thread Python joins).
            return not any(
                t.name.startswith(dcp_compat.DCP_ASYNC_THREAD_PREFIX) and t.is_alive() for t in threading.enumerate()
            )
        alive, current = thread.is_alive(), thread is threading.current_thread()
        with self._frame_lock:
            frame = self._frame
            running = frame is not None and _running(frame)
            if alive and not current:
                if running:
                    return False
                if frame is None and thread.name.startswith(dcp_compat.DCP_ASYNC_THREAD_PREFIX):
                    # DCP's async-save thread took this save at its first hook, which DCP's logger
                    # calls just before DCP's save begins: the thread is about to run it.
                    return False
            if running:
                return True  # asked from the save's own thread
            self._frame = None
            report, self._reported = not self._reported, True
        if report and self.background and not self._ended.is_set() and (frame is not None or not alive):
            # DCP stopped the save between the writer's steps (its planner, or another rank,
            # failed): no hook of ours saw the error, and nobody may ever read the future.
            logger.error(
                "checkpoint save to %s failed in the background: DCP stopped it between the writer's "
                "steps (its error is on the future dcp.async_save returned); nothing was published",
                self.what,
            )
        return True

    def wait(self) -> None:
        """Block until :meth:`over`, or until an unstarted save has waited ``UNSTARTED_WAIT_S``."""
        while not self.over():
            if self.thread is None and time.monotonic() - self.opened > UNSTARTED_WAIT_S:
                logger.error("checkpoint save to %s never started; not waiting for it any longer", self.what)
                return
            self._ended.wait(0.05)


def _outermost_own_frame(filename: str) -> FrameType | None:
    """The outermost frame of the calling thread's stack whose code comes from ``filename`` (the
    thread's own stack only: safe to walk), or None."""
    found = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == filename:
            found = frame
        frame = frame.f_back
    return found


def _running(frame: FrameType) -> bool:
    """Whether ``frame`` is still executing, asked of the frame object alone: ``frame.clear()``
    refuses a frame that is executing (RuntimeError) and otherwise drops its locals, which the
    finished frame of a save no longer needs."""
    try:
        frame.clear()
    except RuntimeError:
        return True
    return False


def _dcp_async_saves() -> list[threading.Thread]:
    """Threads running a THREAD-mode ``dcp.async_save`` now, ours or not, including one still
    waiting for an async stager to finish its copy (no hook of ours has run in it yet): DCP makes an
    executor of one such thread per async save and shuts it down when the save ends, so a live
    thread of that name is a save in flight (or one about to exit)."""
    me = threading.current_thread()
    prefix = dcp_compat.DCP_ASYNC_THREAD_PREFIX
    return [t for t in threading.enumerate() if t is not me and t.is_alive() and t.name.startswith(prefix)]


class _ExitGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets: list[SaveTicket] = []
        self._futures: list[tuple[Future[Any], str]] = []
        self._registered = False

    def install(self) -> None:
        """Register the exit callback now (the writer module does, when imported), so that it also
        covers saves none of our hooks has seen yet (e.g. one waiting for an async stager)."""
        with self._lock:
            self._register()

    def _register(self) -> None:
        if self._registered:
            return
        self._registered = dcp_compat.register_before_thread_pools_shut(self._at_exit)

    def open(self, what: str, background: bool) -> SaveTicket:
        ticket = SaveTicket(what, background=background)
        with self._lock:
            self._register()
            self._prune()
            self._tickets.append(ticket)
        return ticket

    def prune(self) -> None:
        with self._lock:
            self._prune()

    def _prune(self) -> None:
        """Drop the tickets that are over. Called holding the lock."""
        self._tickets = [t for t in self._tickets if not t.over()]

    def watch(self, fut: Future[Any], what: str) -> None:
        with self._lock:
            self._register()
            self._futures = [(f, w) for f, w in self._futures if not f.done()]
            self._futures.append((fut, what))

    def _at_exit(self) -> None:
        with self._lock:
            tickets = [t for t in self._tickets if not t.over()]
            futures = [(f, w) for f, w in self._futures if not f.done()]
        running = _dcp_async_saves()
        if running and not tickets and not futures:
            logger.warning("interpreter exiting: waiting for %d checkpoint save(s) in flight to finish", len(running))
        # Until DCP's save threads are done, nothing may shut the thread pools their writers use.
        while running:
            running[0].join(0.05)
            running = _dcp_async_saves()
        if not tickets and not futures:
            return
        names = sorted({t.what for t in tickets} | {w for _f, w in futures})
        logger.warning(
            "interpreter exiting: waiting for %d checkpoint save(s) in flight to finish, to %s",
            len(names),
            ", ".join(names),
        )
        for ticket in tickets:
            ticket.wait()
        # A failed background save has logged its error already; a foreground one raised it.
        failed: dict[str, BaseException] = {}
        for fut, what in futures:
            try:
                fut.result()
            except BaseException as exc:  # noqa: BLE001 - reported below; nobody else will see it
                failed.setdefault(what, exc)
        for what, error in failed.items():
            logger.error(
                "checkpoint save to %s, in flight at interpreter exit, failed: %s: %s",
                what,
                type(error).__name__,
                error,
            )
        if not failed:
            logger.info("checkpoint saves in flight at exit finished, to %s", ", ".join(names))


_GUARD = _ExitGuard()


def install() -> None:
    """Register the exit callback (idempotent)."""
    _GUARD.install()


def prune() -> None:
    """Forget the saves that are over, with the frames of DCP's ``save`` their tickets held (a save
    DCP failed between our hooks keeps its frame, and the state dict in it, until asked): called
    before a snapshot allocates its copy."""
    _GUARD.prune()


def open_ticket(what: str, *, background: bool = False) -> SaveTicket:
    """Register a save in flight; the interpreter's exit waits until it is over. ``background``:
    an async save, whose failure is logged (at ERROR) when it happens."""
    return _GUARD.open(what, background)


def watch_future(fut: Future[Any], what: str) -> None:
    """The interpreter's exit waits for ``fut`` (a save's future) and logs its error, if any."""
    _GUARD.watch(fut, what)


__all__ = ["SaveTicket", "UNSTARTED_WAIT_S", "install", "open_ticket", "watch_future"]
