"""A bounded pool of transfer workers and a per-checkpoint group that tracks its transfers.

Modelled on s3transfer's design (boto/s3transfer ``futures.py``): a *bounded executor* whose
``submit`` waits when too many tasks are queued, so producers slow down instead of queueing a whole
checkpoint, and a *coordinator* per transfer (:class:`TransferGroup`) that owns the futures, the
first error, cancellation of what has not started when something fails, and the clean-ups to run
on the way out (s3transfer's ``TransferCoordinator.add_failure_cleanup``/``add_done_callback``).

Pools are created per save or load and shut down at its end: DCP's PROCESS mode pickles the storage
writer, and a live pool cannot be pickled.

The threads are :class:`~uc_checkpoint.volumes.workers.Workers`, which keep taking work while the
interpreter exits, so a save that DCP's async thread runs then still publishes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Generic, TypeVar

from uc_checkpoint.errors import TransferError, UCCheckpointError
from uc_checkpoint.volumes.workers import Workers

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TransferPool:
    """A thread pool with at most ``max_workers`` running and ``max_pending`` queued tasks.

    Args:
        max_workers: worker threads (>= 1).
        max_pending: tasks queued beyond the running ones before ``submit`` blocks (default
            ``max_workers``).
        name: thread name prefix, for logs and profilers.
    """

    def __init__(self, max_workers: int, max_pending: int | None = None, name: str = "uc-transfer") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._executor = Workers(max_workers, thread_name_prefix=name)
        #: Tasks running and queued before ``submit`` blocks.
        self.capacity = max_workers + (max_workers if max_pending is None else max_pending)
        self._slots = threading.BoundedSemaphore(self.capacity)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` on a worker; blocks while the pool is full."""
        self._slots.acquire()
        try:
            fut = self._executor.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        return fut

    def shutdown(self, cancel_pending: bool = False) -> None:
        """Wait for running tasks and stop the workers; with ``cancel_pending`` drop queued ones."""
        self._executor.shutdown(wait=True, cancel_futures=cancel_pending)

    def __enter__(self) -> TransferPool:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.shutdown(cancel_pending=exc is not None)


class TransferGroup(Generic[T]):
    """The transfers of one checkpoint on one rank: submit them, then collect all results or the
    first failure.

    ``submit`` may be called from several threads (DCP serialises files on ``thread_count``
    threads and each finished file is submitted from the thread that closed it).

    The group ends once: when :meth:`results` returns or raises, or at the first :meth:`cancel`.
    Then, in the thread that ended it and after every transfer of the group has stopped, it runs
    the *failure clean-ups* (only when it failed or was cancelled), then the *done callbacks*
    (always), each list in registration order. A clean-up or callback that raises is logged and
    the others still run: the way out must not be blocked by one of its steps (as s3transfer's
    ``TransferCoordinator.announce_done``).
    """

    def __init__(self, pool: TransferPool, what: str) -> None:
        self._pool = pool
        self._what = what
        self._futures: list[Future[T]] = []
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._failure_cleanups: list[Callable[[], object]] = []
        self._done_callbacks: list[Callable[[], object]] = []
        self._ended = False

    def add_failure_cleanup(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` once if the group fails or is cancelled, before the done callbacks."""
        with self._lock:
            self._failure_cleanups.append(fn)

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` once when the group ends, whether it succeeded or not."""
        with self._lock:
            self._done_callbacks.append(fn)

    def _end(self, failed: bool) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
            steps = (self._failure_cleanups if failed else []) + self._done_callbacks
        for fn in steps:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one failed clean-up must not skip the others
                logger.exception("%s: clean-up %r failed", self._what, fn)

    def submit(self, fn: Callable[..., T], *args: object) -> None:
        """Queue one transfer; ignored once another transfer of the group has failed."""
        if self._failed.is_set():
            return
        fut = self._pool.submit(fn, *args)
        fut.add_done_callback(self._on_done)
        with self._lock:
            self._futures.append(fut)

    def _on_done(self, fut: Future[T]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._failed.set()

    def cancel(self) -> None:
        """Cancel transfers that have not started, wait for running ones to end, then end the group
        as failed (its failure clean-ups and done callbacks run, unless it ended before)."""
        self._failed.set()
        with self._lock:
            futures = list(self._futures)
        for fut in futures:
            fut.cancel()
        wait(futures)
        self._end(failed=True)

    def results(self) -> list[T]:
        """Wait for every transfer; return their results in submission order.

        Raises:
            TransferError (or the task's own :class:`UCCheckpointError`): the first failure; the
                transfers not yet started are cancelled and running ones are waited for (then the
                group ends as by :meth:`cancel`).
        """
        with self._lock:
            futures = list(self._futures)
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
        if failed:
            self.cancel()
            exc = failed[0].exception()
            assert exc is not None
            logger.error("%s: %d of %d transfers failed; first: %s", self._what, len(failed), len(futures), exc)
            if isinstance(exc, UCCheckpointError):
                raise exc
            raise TransferError(f"{self._what}: {exc}") from exc
        out = [f.result() for f in futures]
        self._end(failed=False)
        return out
