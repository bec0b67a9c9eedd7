"""A bounded pool of transfer workers and a per-checkpoint group that tracks its transfers.

Modelled on s3transfer's design (boto/s3transfer ``futures.py``): a *bounded executor* whose
``submit`` waits when too many tasks are queued, so producers slow down instead of queueing a whole
checkpoint, and a *coordinator* per transfer (:class:`TransferGroup`) that owns the futures, the
first error, and cancellation of what has not started when something fails.

Pools are created per save or load and shut down at its end: DCP's PROCESS mode pickles the storage
writer, and a live pool cannot be pickled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

from .errors import TransferError, UCCheckpointError

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
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(max_workers + (max_workers if max_pending is None else max_pending))

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
    """

    def __init__(self, pool: TransferPool, what: str) -> None:
        self._pool = pool
        self._what = what
        self._futures: list[Future[T]] = []
        self._lock = threading.Lock()
        self._failed = threading.Event()

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
        """Cancel transfers that have not started, and wait for running ones to end."""
        self._failed.set()
        with self._lock:
            futures = list(self._futures)
        for fut in futures:
            fut.cancel()
        wait(futures)

    def results(self) -> list[T]:
        """Wait for every transfer; return their results in submission order.

        Raises:
            TransferError (or the task's own :class:`UCCheckpointError`): the first failure; the
                transfers not yet started are cancelled and running ones are waited for.
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
        return [f.result() for f in futures]
