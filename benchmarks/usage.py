"""CPU seconds and memory of a process, for the benchmark's client and store figures: psutil for CPU
time and the current RSS; the peak RSS from ``/proc``, which psutil does not give on Linux.

The runner tells a case the pid of the S3 server's process in :data:`STORE_PID_ENV` (its own pid
for in-process moto, whose threads serve from the runner), so that a case can split the store's CPU
per timed call.
"""

from __future__ import annotations

import os

import psutil

#: Environment variable through which the runner tells a case the pid of the S3 server's process.
STORE_PID_ENV = "UC_BENCH_STORE_PID"


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (None: this one) so far, all its threads, not its
    children (clock-tick resolution, 10 ms on Linux).

    Raises:
        psutil.NoSuchProcess: there is no process ``pid``.
    """
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def store_cpu_s() -> float | None:
    """CPU seconds so far of the S3 server the runner named in :data:`STORE_PID_ENV`; None when it
    named none (a case run by hand) or the process is gone."""
    pid = os.environ.get(STORE_PID_ENV)
    if not pid:
        return None
    try:
        return cpu_s(int(pid))
    except (psutil.Error, ValueError):
        return None


def rss_bytes() -> int:
    """This process's resident set size now, in bytes."""
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes(pid: int | None = None) -> int | None:
    """The peak resident set size of process ``pid`` (None: this one) in bytes (``VmHWM`` of
    ``/proc/<pid>/status``, since the process started or since :func:`reset_peak_rss`); None when it
    cannot be read (the process is gone, or not Linux)."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_above(base: int) -> int:
    """Bytes this process's peak RSS reached above ``base`` (its :func:`rss_bytes` read before the
    phase, when :func:`reset_peak_rss` started the peak over); 0 where the peak cannot be read."""
    peak = peak_rss_bytes()
    return 0 if peak is None else max(0, peak - base)


def reset_peak_rss() -> None:
    """Start this process's peak RSS over from its current RSS, where the kernel allows it
    (``/proc/self/clear_refs``); otherwise the peak keeps counting from the process start."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass
