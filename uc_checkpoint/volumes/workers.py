"""The one kind of thread pool the package runs transfers on: :class:`Workers`.

Not :class:`concurrent.futures.ThreadPoolExecutor`: at interpreter exit ``concurrent.futures`` marks
every ``ThreadPoolExecutor`` as shut down ("cannot schedule new futures after interpreter
shutdown") and then joins their workers, DCP's async-save thread among them. A save still running
there must go on handing files to its pools (the upload pool, boto3's transfer manager), as stock
``FileSystemWriter`` goes on writing in that thread: then the exit waits for the save and it
publishes, with no exit hook of ours.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class Workers(Executor):
    """A :class:`concurrent.futures.Executor` of up to ``max_workers`` daemon threads, started as
    work arrives, that keeps taking work while the interpreter exits (see the module docstring).

    Whoever submits waits for the futures it needs: a daemon thread left running at the very end of
    finalisation is stopped, so work nobody waits for may not complete. The class also serves as
    s3transfer's ``executor_cls`` (it is called with ``max_workers`` only).

    Args:
        max_workers: threads at most (>= 1).
        thread_name_prefix: their names' prefix, for logs and profilers.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "uc-worker") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue[
            tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None
        ] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on a worker thread; returns its future.

        Raises:
            RuntimeError: the pool was shut down.
        """
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work on a pool that was shut down")
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._run, name=f"{self._prefix}_{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return future

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del item, future, fn, args, kwargs  # nothing of a finished task stays referenced here
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; with ``cancel_futures`` cancel what has not started; with ``wait``
        wait for the threads to finish what they run."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            threads = list(self._threads)
            for _ in threads:
                self._work.put(None)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
