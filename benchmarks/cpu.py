"""CPU seconds and memory of a process, for the benchmark's client and store figures (no heavy
imports: the runner, its cases and the S3 server helpers all use it)."""

from __future__ import annotations

import os

#: Environment variable through which the runner tells a case the pid of the S3 server's process
#: (its own pid for moto, which runs as threads of the runner).
STORE_PID_ENV = "UC_BENCH_STORE_PID"


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (``/proc/<pid>/stat``
    fields utime and stime; clock-tick resolution, 10 ms on Linux)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        # The command name (field 2) is in parentheses and may hold spaces: split after it.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    """User + system CPU seconds of this process so far, all its threads, not its children."""
    t = os.times()
    return t.user + t.system


def store_cpu_s() -> float | None:
    """CPU seconds so far of the S3 server the runner named in :data:`STORE_PID_ENV`; None when it
    named none (a case run by hand) or the process is gone."""
    pid = os.environ.get(STORE_PID_ENV)
    if not pid:
        return None
    try:
        return process_cpu_s(int(pid))
    except (OSError, ValueError):
        return None


def rss_kib(field: str) -> int:
    """This process's ``/proc/self/status`` memory field ``field`` (``VmRSS``, ``VmHWM``) in KiB; 0
    when absent."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> None:
    """Start this process's peak RSS (``VmHWM``) over from its current RSS, where the kernel allows
    it (``/proc/self/clear_refs``); otherwise the peak keeps counting from the process start."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass
