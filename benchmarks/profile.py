"""Where a save's and a load's client CPU goes: py-spy (native frames included) on ours against S3,
written as a breakdown table into ``docs/benchmarks-profile.md``::

    python -m benchmarks.profile                  # 256 MiB GPT-like state, 3 saves and 3 loads
    python -m benchmarks.profile --size-mb 64 --repeats 5

One case process (:mod:`benchmarks.profile_case`) talks to moto's S3 server in its own process (its
CPU is not sampled). It prepares, then saves ``--repeats`` times (sampled), then loads ``--repeats``
times (sampled separately): py-spy attaches to it for each phase, records every thread at 250 Hz
with native frames, and samples of idle threads (waiting on a lock, a queue, a socket) are dropped,
so each table is the phase's CPU. Each sample is charged to the first category, in the order of
:data:`CATEGORIES`, whose pattern matches its stack. Needs py-spy (the ``bench`` extra) and
permission to attach (root, or ``ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import logging
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .run import REPO, case_env
from .scale import BUCKET, store
from .servers import FAKE_ENV

log = logging.getLogger("benchmarks.profile")

#: (category, regex over one frame, ``function (file:line)``). A sample is charged to the innermost
#: frame of its stack that matches a category (the first category, in this order, that it matches):
#: zlib's ``crc32_z`` names no category, so the CRC is charged to the Python frame that asked for it.
CATEGORIES: list[tuple[str, str]] = [
    ("benchmark set-up (random state, zero targets)", r"benchmarks/state\.py"),
    ("SigV4 SHA-256 of bodies (plain HTTP)", r"sha256|SHA256"),
    ("botocore CRC-32 of bodies (flexible checksums)", r"botocore/(?:httpchecksum|checksums)\.py"),
    ("our CRC-32: file digest, block verification", r"uc_checkpoint/format/integrity\.py"),
    ("range buffers (allocation, first touch)", r"_Buffers\.take|RangeFetch\.begin"),
    ("receiving bodies (socket reads)", r"recv|readinto|_safe_read"),
    ("sending bodies (socket writes)", r"sendall|_send_output|sendfile"),
    ("copying loaded bytes into the plan's tensors", r"decode_into|ItemCodec\.decode|ItemLoader|copy_"),
    ("serialising tensors into staging files", r"ItemCodec\.write|_write_file|save_without_zip_crc|mz_zip"),
    ("s3transfer reading staged files", r"ReadFileChunk|s3transfer/utils\.py"),
    ("botocore request building, signing, parsing", r"botocore/"),
    ("s3transfer bookkeeping", r"s3transfer/"),
    ("our pipeline (upload/fetch scheduling, publish)", r"uc_checkpoint/"),
    ("DCP planning and collectives", r"torch/distributed/checkpoint/"),
    ("garbage collector", r"gc_collect"),
]
_COMPILED = [(name, re.compile(pattern)) for name, pattern in CATEGORIES]
#: Leaf frames of a thread that is waiting, not running: such samples are not CPU.
IDLE = re.compile(
    r"(?:acquire_lock|cond_timedwait|cond_wait|sem_wait|sem_timedwait|epoll_wait|select|poll|clock_nanosleep)"
)
#: Python frames that only wait (a lock, a condition, a queue, a future): a sample whose innermost
#: Python frame is one of them, with nothing below it or only a libc frame py-spy could not name
#: (a futex wait), is not CPU either.
WAITING = re.compile(r"\((?:threading|queue|concurrent/futures/_base)\.py:\d+\)$")
_UNNAMED_LIBC = re.compile(r"^0x[0-9a-f]+ \(libc\.so")


def _idle(frames: list[str]) -> bool:
    if IDLE.search(";".join(frames[-3:])):
        return True
    inner = frames[:-1] if frames and _UNNAMED_LIBC.search(frames[-1]) else frames
    return bool(inner) and WAITING.search(inner[-1]) is not None


def breakdown(raw: str) -> tuple[collections.Counter[str], int]:
    """Samples per category of py-spy's raw (collapsed) output ``raw``, idle samples dropped; and
    the number of samples kept."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        if _idle(stack.split(";")):
            continue
        total += int(n)
        counts[_category(stack.split(";"))] += int(n)
    return counts, total


def _category(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for name, pattern in _COMPILED:
            if pattern.search(frame):
                return name
    return "other"


def table(counts: collections.Counter[str], total: int, measured_cpu_s: float, gib: float) -> list[str]:
    """Markdown rows: category, its share of the samples, and that share of the phase's measured
    client CPU (``os.times``) per GiB moved."""
    rows = ["| where | share of samples | CPU-s/GiB |", "|---|---|---|"]
    for name, n in counts.most_common():
        rows.append(f"| {name} | {100 * n / total:.0f}% | {measured_cpu_s * n / total / gib:.2f} |")
    rows.append(f"| **measured client CPU (os.times)** | 100% | **{measured_cpu_s / gib:.2f}** |")
    return rows


def _attach(pid: int, out: Path, rate: int) -> subprocess.Popen[bytes]:
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    return subprocess.Popen(
        [pyspy, "record", "--native", "-r", str(rate), "-f", "raw", "-o", str(out), "--pid", str(pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate", type=int, default=250, help="samples per second per thread")
    p.add_argument("--report", default=str(REPO / "docs" / "benchmarks-profile.md"))
    p.add_argument("--raw-dir", help="keep py-spy's raw (collapsed) stacks here, one file per phase")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    work = Path(tempfile.mkdtemp(prefix="uc-profile-"))
    sections: dict[str, tuple[collections.Counter[str], int, float, float]] = {}
    try:
        with store(work, counted=False) as s3:
            env = {**case_env(s3.endpoint, work / "staging"), **FAKE_ENV}
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.profile_case",
                    f"s3://{BUCKET}/profile",
                    str(args.size_mb),
                    str(args.repeats),
                    str(work),
                ],
                cwd=REPO,
                env=env,
            )
            for phase in ("save", "load"):
                ready, done = work / f"{phase}.ready", work / f"{phase}.done"
                while not ready.exists():
                    if proc.poll() is not None:
                        raise SystemExit(f"the case process ended before its {phase} phase (exit {proc.returncode})")
                    time.sleep(0.05)
                out = work / f"{phase}.txt"
                spy = _attach(proc.pid, out, args.rate)
                time.sleep(1.0)  # py-spy attaches before the phase starts
                (work / f"{phase}.go").touch()
                while not done.exists():
                    if proc.poll() is not None:
                        raise SystemExit(f"the case process ended during its {phase} phase (exit {proc.returncode})")
                    time.sleep(0.05)
                spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT, not SIGTERM
                _, err = spy.communicate(timeout=60)
                if not out.exists():
                    raise SystemExit(f"py-spy wrote nothing for the {phase} phase: {err.decode(errors='replace')}")
                counts, total = breakdown(out.read_text())
                sections[phase] = (counts, total, float((work / f"{phase}.cpu").read_text()), total / args.rate)
                if args.raw_dir:
                    Path(args.raw_dir).mkdir(parents=True, exist_ok=True)
                    shutil.copy(out, Path(args.raw_dir) / out.name)
            proc.wait(timeout=600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gib = args.size_mb * args.repeats / 1024
    lines = [
        "# Where the client CPU goes",
        "",
        "Generated by `python -m benchmarks.profile` (run by `./scripts/bench.sh`); do not edit by hand. "
        f"{args.size_mb} MiB GPT-like state (16/4/1 MiB float32 tensors), 1 rank, ours to S3 (moto in its "
        f"own process, not sampled), {args.repeats} synchronous saves then {args.repeats} loads into zeros; "
        f"py-spy `--native` at {args.rate} Hz on every thread, idle samples dropped; CPU-s per GiB moved. "
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
    ]
    for phase, (counts, total, measured, sampled_s) in sections.items():
        lines += [
            "",
            f"## {phase}",
            "",
            f"Samples of running threads: {sampled_s:.2f} thread-seconds; measured CPU: {measured:.2f} s. py-spy "
            "cannot always tell a thread waiting inside C code from one running, so the shares are of samples "
            "and the CPU-s/GiB column spreads the measured CPU by them.",
            "",
            *table(counts, total, measured, gib),
        ]
    Path(args.report).write_text("\n".join(lines) + "\n")
    log.info("wrote %s", args.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
