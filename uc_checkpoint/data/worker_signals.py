"""DataLoader workers that leave the signals which stop a job to their rank.

A job is stopped by a signal to its processes: torchrun's agent passes the one it gets on to each
rank's process group, Slurm signals every process of a job step, a systemd or cgroup stop and a
Kubernetes pod termination signal every process of the unit. A DataLoader worker dies of each by
default (torch's own SIGTERM handler lets it die unless its rank sent the signal), and a rank whose
worker died fails at its next batch (``DataLoader worker (pid N) is killed by signal: Terminated``),
before it can finish its step and take its final checkpoint. :func:`leave_stop_signals_to_the_rank`
keeps a worker serving batches until its rank stops it or is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Any

logger = logging.getLogger(__name__)

#: Signals that stop a job: torchrun's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT (its
#: ``--signals-to-handle`` default) and passes them on to the ranks, Slurm sends SIGTERM (or, with
#: ``--signal``, SIGUSR1/SIGUSR2) to every process of a step, systemd, cgroup and Kubernetes stops
#: send SIGTERM. A DataLoader worker dies of each by default, and a rank whose worker died fails at
#: its next batch.
WORKER_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


@contextmanager
def stop_signals_blocked_for(start_method: str | None) -> Iterator[None]:
    """Start DataLoader workers inside this block (``iter(loader)``): the stop signals
    (:data:`WORKER_STOP_SIGNALS`) are blocked in the calling thread meanwhile, so that a worker
    inherits the mask from its first instruction. Threads start in a worker before its
    ``worker_init_fn`` runs (a spawned interpreter's BLAS thread pool while it imports, a library's
    fork handlers in a forked one); a signal sent to the worker that the kernel hands to one of them
    would end it by default, whatever :func:`leave_stop_signals_to_the_rank` arranged.
    ``multiprocessing``'s resource tracker is started first: starting it unblocks SIGINT and
    SIGTERM in the calling thread. A stop signal sent to this process meanwhile reaches another of
    its threads or waits until the block ends. Workers of a ``"forkserver"`` (``start_method``)
    are forked by that server, whose mask this cannot set: nothing is blocked for them.
    """
    if start_method == "forkserver" or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    if start_method != "fork":
        resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _stop_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_method_of(loader: Any) -> str | None:
    """The start method of ``loader``'s workers (a DataLoader's ``multiprocessing_context``, a
    context or its name), or None for the platform's default."""
    ctx = getattr(loader, "multiprocessing_context", None)
    if ctx is None:
        return multiprocessing.get_start_method(allow_none=True)
    return ctx if isinstance(ctx, str) else ctx.get_start_method()


def _stop_signals() -> set[int]:
    return {getattr(signal, name) for name in WORKER_STOP_SIGNALS if hasattr(signal, name)}


def leave_stop_signals_to_the_rank(rank_pid: int | None = None) -> None:
    """Call in a DataLoader worker (first thing in its ``worker_init_fn``;
    :class:`~uc_checkpoint.data.loading.TrackedDataLoader` does it for its workers): a stop signal (:data:`WORKER_STOP_SIGNALS`) sent by anyone but the
    worker's rank is ignored; one sent by the rank (``rank_pid``, default the worker's parent: the
    DataLoader stopping a worker that did not exit when told, or ``multiprocessing`` at the rank's
    exit) ends the worker at once, as torch's own SIGTERM handler for workers does.

    The signals are blocked in the worker's main thread (threads started later inherit the mask)
    and a daemon thread takes them with ``sigwaitinfo``, which names the sender. So a job-wide stop
    (``kill -TERM -- -<pgid>``, Slurm, a cgroup or pod stop, torchrun passing SIGTERM on to a rank's
    process group) reaches the rank, which finishes its step and takes its final checkpoint, while
    its workers go on serving batches until the rank shuts them down or exits (the DataLoader's
    watchdog ends a worker whose rank is gone). Needs ``signal.sigwaitinfo`` (Linux and most POSIX
    systems; not macOS or Windows, where workers keep torch's handlers).
    """
    if not (hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask")):
        return
    stops = _stop_signals()
    parent = os.getppid()
    stoppers = {parent} if rank_pid is None else {rank_pid, parent}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    threading.Thread(
        target=_serve_stop_signals, args=(stops, stoppers), name="uc-worker-stop-signals", daemon=True
    ).start()


def _serve_stop_signals(stops: set[int], stoppers: set[int]) -> None:
    """Take the blocked stop signals one by one; exit the worker on one from ``stoppers``."""
    while True:
        info = signal.sigwaitinfo(stops)
        if info.si_pid in stoppers:
            os._exit(0)
        logger.debug(
            "data-loader worker %d: %s from pid %d left to the rank",
            os.getpid(),
            signal.Signals(info.si_signo).name,
            info.si_pid,
        )


__all__ = ["WORKER_STOP_SIGNALS", "leave_stop_signals_to_the_rank", "start_method_of", "stop_signals_blocked_for"]
