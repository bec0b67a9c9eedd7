"""The package's thread pool (uc_checkpoint.volumes.workers.Workers): bounded threads started as
work arrives, futures with results and errors, cancellation at shutdown, and work taken while the
interpreter exits, where concurrent.futures refuses it."""

from __future__ import annotations

import concurrent.futures.thread
import threading

import pytest

from uc_checkpoint.volumes.workers import Workers


def test_runs_work_on_at_most_max_workers_threads() -> None:
    pool = Workers(2, thread_name_prefix="t-pool")
    gate = threading.Event()
    names: set[str] = set()
    lock = threading.Lock()

    def task(i: int) -> int:
        with lock:
            names.add(threading.current_thread().name)
        assert gate.wait(10)
        return i * i

    futures = [pool.submit(task, i) for i in range(6)]
    gate.set()
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(6)]
    assert 1 <= len(names) <= 2 and all(n.startswith("t-pool_") for n in names), names
    pool.shutdown()


def test_an_error_reaches_the_future_and_the_pool_goes_on() -> None:
    pool = Workers(1)

    def boom() -> None:
        raise KeyError("gone")

    with pytest.raises(KeyError, match="gone"):
        pool.submit(boom).result(timeout=10)
    assert pool.submit(lambda: 7).result(timeout=10) == 7
    pool.shutdown()


def test_shutdown_cancels_queued_work_and_refuses_more() -> None:
    pool = Workers(1)
    started, release = threading.Event(), threading.Event()

    def hold() -> str:
        started.set()
        assert release.wait(10)
        return "ran"

    running = pool.submit(hold)
    assert started.wait(10)
    queued = pool.submit(lambda: "never")
    stopper = threading.Thread(target=pool.shutdown, kwargs={"cancel_futures": True})
    stopper.start()
    release.set()
    stopper.join(10)
    assert running.result(timeout=10) == "ran" and queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)


def test_work_is_taken_while_the_interpreter_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    # What concurrent.futures' exit callback sets before it joins its workers (DCP's async-save
    # thread among them): every ThreadPoolExecutor then refuses new work; a save in that thread
    # must still hand its files to ours.
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        concurrent.futures.ThreadPoolExecutor(1).submit(lambda: None)
    pool = Workers(2)
    assert pool.submit(sum, [1, 2, 3]).result(timeout=10) == 6
    pool.shutdown()


def test_the_package_runs_no_thread_pool_of_concurrent_futures() -> None:
    # Any ThreadPoolExecutor in a save's path would refuse work during the interpreter's exit.
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "uc_checkpoint"
    found = [
        f"{path.relative_to(package)}:{n}"
        for path in sorted(package.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "ThreadPoolExecutor(" in line or "ProcessPoolExecutor(" in line
    ]
    assert not found, found
