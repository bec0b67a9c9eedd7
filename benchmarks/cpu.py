"""CPU seconds of a process, for the benchmark's client and store figures (no heavy imports: the
runner, its cases and the S3 server helpers all use it)."""

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
