"""How each cost grows: the scale benchmark (issue 16). One command measures five sweeps side by side
and writes ``docs/benchmarks/scale.json``, ``docs/benchmarks/scale-*.png``, ``docs/benchmarks-scale.md``
and the "Scale" section of ``docs/benchmarks.md``::

    python -m benchmarks.scale            # the full grid (about 10 minutes on 2 cores, 2 repeats)
    python -m benchmarks.scale --quick    # a reduced grid in about 70 s
    python -m benchmarks.scale --only checkpoints --checkpoints 10 100 1000

Sweeps (each point a fresh process, or a torchrun job, against a fresh S3 server):

==============  ===================================================================================
``ranks``       1 -> 8 ranks at a fixed total size (``--ranks-total-mb``) and at a fixed share per
                rank (``--share-mb``): save (to ``.metadata`` on the store) and load seconds, data
                files per rank, requests of the save and of the load
``size``        64 MiB -> 2 GiB on 1 rank: save / load seconds and client CPU-s/GiB, and raw boto3's
                download of the same objects; on moto and, where it imports, on localbucket (a
                disk-backed S3 server that reads only the bytes a ranged GET asks for)
``tensors``     100 -> 50,000 tensors at a fixed small size: save / load seconds per tensor (ours to
                S3, and DCP's FileSystemWriter to local disk as the reference)
``checkpoints`` 10 -> 1,000 checkpoints under one root: time and requests of
                ``CheckpointManager.latest()`` / ``list()``, ``uc-checkpoint ls`` (``list_root``),
                ``gc --dry-run`` (``collect_garbage(dry_run=True)``) and a save's housekeeping
``reshard``     save with 4 ranks, load with 4 and with 2 (torchrun, gloo on the CPU)
==============  ===================================================================================

The S3 server is moto (the size sweep also localbucket), in its own process (so the client CPU
figures do not include it), restarted for every point (moto keeps objects in memory, those over 5 MiB in temporary files). Requests are counted on the wire by the tests' fault
proxy (``tests/support/s3_fixtures.FaultProxy``, in this process) for the ``ranks``, ``reshard`` and
``checkpoints`` sweeps; ``size`` and ``tensors`` talk to the server directly. The many checkpoints of
the ``checkpoints`` sweep are one real save of a tiny state, its objects copied server-side to N
step locations. The report states each cost's growth from the measured points
(:func:`benchmarks.scale_report.growth`) and flags any that grows faster than it must.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uc_checkpoint.dcp.options import Staging

from .run import case_env, host_facts
from .servers import FAKE_ENV, localbucket_available, localbucket_process, make_bucket, moto_process
from .usage import peak_rss_bytes

log = logging.getLogger("benchmarks.scale")
REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
BUCKET = "scalebench"
SWEEPS = ("ranks", "size", "tensors", "checkpoints", "reshard")

#: The full grid, and the reduced one of ``--quick`` (about a minute on 2 cores).
FULL = {
    "ranks": [1, 2, 4, 8],
    "ranks_total_mb": 256,
    # A share between 16 and 32 MiB: 2 files per rank, away from the boundary the gpt shapes' rounding
    # could cross.
    "share_mb": 24,
    "sizes_mb": [64, 256, 1024, 2048],
    "tensors": [100, 1000, 10000, 50000],
    "tensors_total_mb": 16,
    "checkpoints": [10, 100, 1000],
    "reshard": "4:2",
    "reshard_mb": 128,
    "repeats": 2,
}
QUICK = {
    "ranks": [1, 2],
    "ranks_total_mb": 32,
    "share_mb": 0,
    "sizes_mb": [16, 48],
    "tensors": [100, 1000],
    "tensors_total_mb": 4,
    "checkpoints": [10, 40],
    "reshard": "2:1",
    "reshard_mb": 16,
    "repeats": 1,
}


# -- the store ------------------------------------------------------------------------------


@dataclass
class Store:
    """A running S3 server (``direct``) and, when requests are counted, the fault proxy in front
    of it (``endpoint`` is what clients use)."""

    direct: str
    endpoint: str
    proxy: Any
    pid: int

    def peak_rss_mib(self) -> float | None:
        """The server process's peak RSS so far, in MiB; None once it is gone."""
        peak = peak_rss_bytes(self.pid)
        return None if peak is None else peak / 2**20


@contextlib.contextmanager
def store(work: Path, *, counted: bool, kind: str = "moto") -> Iterator[Store]:
    """An S3 server in its own process on a free port (its CPU and memory are not the client's),
    with bucket :data:`BUCKET`, and with ``counted`` the fault proxy in front of it. ``kind``:
    ``moto`` (objects in memory, those over 5 MiB in temporary files) or ``localbucket`` (objects in
    files under ``work``, removed after); :mod:`benchmarks.servers` starts either."""
    root = work / f"localbucket-{uuid.uuid4().hex[:8]}"
    server = localbucket_process(root / "data") if kind == "localbucket" else moto_process(work)
    try:
        with server as (url, pid):
            make_bucket(url, BUCKET)
            if counted:
                from tests.support.s3_fixtures import FaultProxy

                with FaultProxy(url) as proxy:
                    yield Store(url, proxy.url, proxy, pid)
            else:
                yield Store(url, url, None, pid)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def api_of(method: str, path: str) -> str:
    """The S3 API call of one request (path-style target), coarsely: LIST, GET, HEAD, PUT, PART (an
    UploadPart), MPU (create / complete / abort a multipart upload), DELETE."""
    target, _, query = path.partition("?")
    params = {p.split("=", 1)[0] for p in query.split("&") if p}
    key = target.lstrip("/").partition("/")[2]
    if method == "GET":
        return "LIST" if not key or params & {"list-type", "prefix", "delimiter", "uploads"} else "GET"
    if method == "PUT":
        return "PART" if "partNumber" in params else "PUT"
    if method == "POST":
        return "DELETE" if "delete" in params else "MPU"
    if method == "DELETE":
        return "MPU" if "uploadId" in params else "DELETE"
    return method


def count(records: list[Any]) -> dict[str, int]:
    """Requests by :func:`api_of` kind, plus ``total``."""
    c = collections.Counter(api_of(r.method, r.path) for r in records)
    return {"total": sum(c.values()), **dict(sorted(c.items()))}


def ranged_bytes(records: list[Any]) -> int:
    """Bytes asked for by ranged GETs (``Range: bytes=a-b``); whole-object GETs (``.metadata``) are not
    in it."""
    total = 0
    for r in records:
        value = r.header("Range") if r.method == "GET" else None
        if value and value.startswith("bytes="):
            lo, _, hi = value[len("bytes=") :].partition("-")
            if lo.isdigit() and hi.isdigit():
                total += int(hi) - int(lo) + 1
    return total


def split_at_mark(records: list[Any]) -> tuple[list[Any], list[Any]]:
    """(requests before, requests after) the phase mark of :mod:`benchmarks.scale_case`."""
    from .scale_case import PHASE_MARK

    for i, r in enumerate(records):
        if PHASE_MARK in r.path:
            return records[:i], records[i + 1 :]
    return records, []


# -- one point in a fresh process -------------------------------------------------------------


def run_point(
    work: Path,
    st: Store | None,
    *,
    ranks: int,
    dest: str,
    args: list[str],
    timeout: float,
) -> list[dict[str, Any]]:
    """Run :mod:`benchmarks.scale_case` with ``args`` on ``ranks`` ranks (``st`` None: no S3 server,
    the destination is a local path); one dict per rank."""
    out = work / f"point-{uuid.uuid4().hex[:8]}.json"
    staging = work / "staging"
    staging.mkdir(exist_ok=True)
    common = ["--dest", dest, "--out", str(out), "--timeout", str(timeout), *args]
    if st is not None:
        common += ["--probe-endpoint", st.direct]
    if ranks == 1:
        cmd = [sys.executable, "-m", "benchmarks.scale_case", *common]
    else:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        cmd = [torchrun, "--standalone", f"--nproc_per_node={ranks}", "-m", "benchmarks.scale_case", *common]
    env = {**case_env(st.endpoint if st is not None else "", staging), **FAKE_ENV}
    if st is None:
        del env["AWS_ENDPOINT_URL"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout + 120)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"scale point {' '.join(cmd[-12:])} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    results: list[dict[str, Any]] = json.loads(out.read_text())
    out.unlink()
    return results


def fold(results: list[dict[str, Any]]) -> dict[str, Any]:
    """All ranks of one run as one row: the slowest rank's times, CPU summed over the ranks,
    rank 0's publish time and file counts."""
    row: dict[str, Any] = {
        "ranks": results[0]["ranks"],
        "bytes": sum(r["rank_bytes"] for r in results),
        "share_bytes": max(r["rank_bytes"] for r in results),
    }
    for key in ("save_s", "load_s", "raw_download_s"):
        vals = [r[key] for r in results if key in r]
        if vals:
            row[key] = max(vals)
    for key in ("save_cpu_s", "load_cpu_s", "raw_download_cpu_s"):
        vals = [r[key] for r in results if key in r]
        if vals:
            row[key] = sum(vals)
    first = results[0]
    for key in ("publish_s", "files_per_rank"):
        if key in first:
            row[key] = first[key]
    if "files_per_rank" in row:
        files = row["files_per_rank"]
        row["objects"] = sum(files.values())
        row["files_max"] = max(files.values(), default=0)
        row["files_min"] = min(files.values(), default=0)
    return row


def _median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of every numeric field over repeats; the rest from the first."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        values = [r[key] for r in rows if key in r]
        # Counts that agree stay as they are (ints); measures get their median.
        if isinstance(value, (int, float)) and not isinstance(value, bool) and len(set(values)) > 1:
            out[key] = statistics.median(values)
    out["repeats"] = len(rows)
    return out


def _s3_point(
    work: Path,
    *,
    counted: bool,
    ranks: int,
    args: list[str],
    timeout: float,
    kind: str = "moto",
) -> dict[str, Any]:
    """One save + load against a fresh store of ``kind`` (see :func:`store`); with ``counted``, the
    save's and the load's requests."""
    with store(work, counted=counted, kind=kind) as st:
        dest = f"s3://{BUCKET}/ckpt"
        results = run_point(work, st, ranks=ranks, dest=dest, args=args, timeout=timeout)
        row = fold(results)
        if st.proxy is not None:
            save, load = split_at_mark(list(st.proxy.history))
            row["requests_save"], row["requests_load"] = count(save), count(load)
            row["load_ranged_bytes"] = ranged_bytes(load)
        row["store_peak_rss_mib"] = st.peak_rss_mib()
    return row


# -- the sweeps -----------------------------------------------------------------------------------


def sweep_ranks(work: Path, grid: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    from uc_checkpoint.dcp.serialize import auto_file_size

    series = [("total", w, grid["ranks_total_mb"]) for w in grid["ranks"]]
    if grid["share_mb"]:
        series += [("share", w, grid["share_mb"] * w) for w in grid["ranks"]]
    rows = []
    for name, ranks, total_mb in series:
        reps = []
        for rep in range(grid["repeats"]):
            log.info("ranks: %s series, %d rank(s), %d MiB in all (repeat %d)", name, ranks, total_mb, rep + 1)
            reps.append(
                _s3_point(
                    work,
                    counted=True,
                    ranks=ranks,
                    args=["--state", "gpt", "--size-mb", str(total_mb)],
                    timeout=timeout,
                )
            )
        row = _median_rows(reps)
        share = int(row["share_bytes"])
        row.update(series=name, size_mb=total_mb, expected_files=max(1, -(-share // auto_file_size(share))))
        rows.append(row)
    return rows


def size_stores() -> list[str]:
    """The stores of the size sweep: moto, and localbucket where it imports (see
    :func:`benchmarks.servers.localbucket_available`)."""
    reason = localbucket_available()
    if reason is not None:
        log.info("size: localbucket not run (%s)", reason)
        return ["moto"]
    return ["moto", "localbucket"]


def sweep_size(work: Path, grid: dict[str, Any], timeout: float, stores: list[str]) -> list[dict[str, Any]]:
    """Each size on each store in ``stores``. moto reads a whole object for every ranged GET, under
    a lock per object, so its load time grows with the object size as well as the bytes read (the
    raw boto3 download of the same objects shows it); localbucket reads just the range from its file,
    which tells the client's own growth apart."""
    rows = []
    largest = max(grid["sizes_mb"])
    for kind in stores:
        for size_mb in grid["sizes_mb"]:
            # moto holds every object in memory and slows down with it: its largest point runs once.
            once = kind == "moto" and size_mb == largest and len(grid["sizes_mb"]) > 1
            reps = []
            for rep in range(1 if once else grid["repeats"]):
                log.info("size: %d MiB, 1 rank, %s (repeat %d)", size_mb, kind, rep + 1)
                reps.append(
                    _s3_point(
                        work,
                        counted=False,
                        ranks=1,
                        args=["--state", "gpt", "--size-mb", str(size_mb), "--raw-download"],
                        timeout=timeout,
                        kind=kind,
                    )
                )
            row = _median_rows(reps)
            row.update(size_mb=size_mb, store=kind)
            rows.append(row)
    return rows


def sweep_tensors(work: Path, grid: dict[str, Any], timeout: float, baseline: bool) -> list[dict[str, Any]]:
    rows = []
    for n in grid["tensors"]:
        args = ["--state", "tensors", "--tensors", str(n), "--size-mb", str(grid["tensors_total_mb"])]
        reps, base = [], []
        for rep in range(grid["repeats"]):
            log.info("tensors: %d tensors, %d MiB (repeat %d)", n, grid["tensors_total_mb"], rep + 1)
            reps.append(_s3_point(work, counted=False, ranks=1, args=args, timeout=timeout))
            if baseline:
                local = work / f"fs-{uuid.uuid4().hex[:8]}"
                base.append(
                    fold(
                        run_point(work, None, ranks=1, dest=str(local), args=[*args, "--writer", "fs"], timeout=timeout)
                    )
                )
                shutil.rmtree(local, ignore_errors=True)
        row = _median_rows(reps)
        row["tensors"] = n
        if base:
            b = _median_rows(base)
            row["fs_save_s"], row["fs_load_s"] = b["save_s"], b["load_s"]
        rows.append(row)
    return rows


def tiny_state(step: int) -> dict[str, Any]:
    import torch

    return {"w": torch.full((16,), float(step)), "meta": {"step": step}}


def _timed(fn: Callable[[], Any], proxy: Any, repeats: int) -> tuple[Any, float, dict[str, int]]:
    """(result, median seconds, requests of the first call)."""
    times, sent, result = [], None, None
    for _ in range(repeats):
        proxy.reset()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        if sent is None:
            sent = count(list(proxy.history))
    assert sent is not None
    return result, statistics.median(times), sent


def sweep_checkpoints(work: Path, grid: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for n in grid["checkpoints"]:
        log.info("checkpoints: %d under one root", n)
        rows.append(_checkpoints_point(work, n, grid["repeats"]))
    return rows


def _checkpoints_point(work: Path, n: int, reps: int) -> dict[str, Any]:
    from uc_checkpoint import CheckpointManager, collect_garbage, list_root
    from uc_checkpoint.format.layout import checkpoint_name
    from uc_checkpoint.volumes import S3Volume

    with store(work, counted=True) as st:
        from tests.support.s3_fixtures import s3_client

        client = s3_client(st.direct)
        root = f"s3://{BUCKET}/run"
        CheckpointManager(S3Volume(root, endpoint_url=st.direct), keep_last=None, staging=Staging(mode="sync")).save(
            1, tiny_state(1)
        )
        first = checkpoint_name(1)
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"run/{first}/")["Contents"]]

        # N saves would take minutes: copy the one real checkpoint's objects server-side instead.
        def copy(step: int) -> None:
            for key in keys:
                dst = key.replace(f"/{first}/", f"/{checkpoint_name(step)}/", 1)
                client.copy_object(Bucket=BUCKET, Key=dst, CopySource={"Bucket": BUCKET, "Key": key})

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(copy, range(2, n + 1)))
        vol = S3Volume(root, endpoint_url=st.endpoint)  # through the proxy: every request counted
        vol.client  # noqa: B018 - built before counting
        row: dict[str, Any] = {"checkpoints": n, "objects_per_checkpoint": len(keys)}
        got, row["latest_s"], row["latest_requests"] = _timed(
            lambda: CheckpointManager(vol, staging=Staging(mode="sync")).latest(), st.proxy, max(3, reps)
        )
        assert got == n, f"latest() returned {got}, expected {n}"
        got, row["list_s"], row["list_requests"] = _timed(
            lambda: CheckpointManager(vol, staging=Staging(mode="sync")).list(), st.proxy, reps
        )
        assert len(got) == n, f"list() returned {len(got)} checkpoints, expected {n}"
        got, row["ls_s"], row["ls_requests"] = _timed(lambda: list_root(vol), st.proxy, reps)
        # ls checks the newest checkpoint; older ones are listed as published, unread.
        assert got[-1].state == "complete" and {s.state for s in got} <= {"complete", "published"}, "ls: states"
        got, row["gc_s"], row["gc_requests"] = _timed(
            lambda: collect_garbage(vol, include_staging=False, dry_run=True), st.proxy, reps
        )
        assert not got.deleted_files, f"gc --dry-run would delete {got.deleted_files[:3]}"
        # The store's own cost of one LIST of one location (moto scans every key of the bucket).
        one = S3Volume(f"{root}/{checkpoint_name(n)}", endpoint_url=st.endpoint)
        _, row["store_list_s"], _ = _timed(one.list_files, st.proxy, max(3, reps))
        # A save's housekeeping with every checkpoint kept (keep_every=1): the second save of a
        # resumed run (the first also checks for a rollback).
        manager = CheckpointManager(vol, keep_last=2, keep_every=1, staging=Staging(mode="sync"))
        manager.latest()
        manager.save(n + 1, tiny_state(n + 1))
        _, row["save_s"], row["save_requests"] = _timed(lambda: manager.save(n + 2, tiny_state(n + 2)), st.proxy, 1)
    return row


def sweep_reshard(work: Path, grid: dict[str, Any], timeout: float) -> dict[str, Any]:
    saved, loaded = (int(x) for x in grid["reshard"].split(":"))
    size = str(grid["reshard_mb"])
    log.info("reshard: save on %d ranks, load on %d and on %d (%s MiB)", saved, saved, loaded, size)
    out: dict[str, Any] = {"saved_ranks": saved, "loaded_ranks": loaded, "size_mb": grid["reshard_mb"]}
    with store(work, counted=True) as st:
        dest = f"s3://{BUCKET}/reshard"
        base = ["--state", "global", "--size-mb", size]
        for phase, ranks, key in (("save", saved, "save"), ("load", saved, "load_same"), ("load", loaded, "load")):
            st.proxy.reset()
            row = fold(run_point(work, st, ranks=ranks, dest=dest, args=[*base, "--phase", phase], timeout=timeout))
            out[f"{key}_s"] = row[f"{phase}_s"]
            out[f"{key}_cpu_s"] = row[f"{phase}_cpu_s"]
            out[f"{key}_requests"] = count(list(st.proxy.history))
            out[f"{key}_ranged_bytes"] = ranged_bytes(list(st.proxy.history))
            if phase == "save":
                out["bytes"] = row["bytes"]
                out["objects"] = row.get("objects")
    out["verified"] = True  # each load compared every tensor with the saved content, or failed
    return out


# -- the run ---------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """Where the run was: :func:`benchmarks.run.host_facts`, the commit and how busy the machine was."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        **host_facts(),
        "commit": commit.stdout.strip() or None,
        # Others may share the machine: the report shows how busy it was.
        "load_average": round(os.getloadavg()[0], 2),
    }


def grid_from(args: argparse.Namespace) -> dict[str, Any]:
    """The grid: the full or ``--quick`` defaults, each overridden by its option when given."""
    grid = dict(QUICK if args.quick else FULL)
    for key in FULL:
        value = getattr(args, key)
        if value is not None:
            grid[key] = value
    return grid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a reduced grid (about a minute)")
    p.add_argument("--only", nargs="+", choices=SWEEPS, default=list(SWEEPS), help="sweeps to run (default all)")
    p.add_argument("--ranks", nargs="+", type=int, help=f"world sizes (default {FULL['ranks']})")
    p.add_argument("--ranks-total-mb", type=int, help=f"fixed total size of the ranks sweep ({FULL['ranks_total_mb']})")
    p.add_argument(
        "--share-mb", type=int, help=f"fixed share per rank of its second series, 0: none ({FULL['share_mb']})"
    )
    p.add_argument("--sizes-mb", nargs="+", type=int, help=f"checkpoint sizes on 1 rank ({FULL['sizes_mb']})")
    p.add_argument("--tensors", nargs="+", type=int, help=f"numbers of tensors ({FULL['tensors']})")
    p.add_argument("--tensors-total-mb", type=int, help=f"total size of the tensors sweep ({FULL['tensors_total_mb']})")
    p.add_argument(
        "--no-tensor-baseline", action="store_true", help="skip DCP's FileSystemWriter reference (--quick skips it)"
    )
    p.add_argument("--checkpoints", nargs="+", type=int, help=f"checkpoints under one root ({FULL['checkpoints']})")
    p.add_argument("--reshard", help=f"SAVED:LOADED ranks ({FULL['reshard']})")
    p.add_argument("--reshard-mb", type=int, help=f"size of the resharded checkpoint ({FULL['reshard_mb']})")
    p.add_argument("--repeats", type=int, help="repeats per point, medians reported (the largest size runs once)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one point may take")
    p.add_argument("--out", default=str(DOCS / "benchmarks" / "scale.json"), help="raw results (JSON)")
    p.add_argument("--report", default=str(DOCS / "benchmarks-scale.md"), help="the scale report (markdown)")
    p.add_argument(
        "--main-report",
        default=str(DOCS / "benchmarks.md"),
        help="the benchmark report whose Scale section is updated ('' to leave it alone)",
    )
    p.add_argument("--workdir", help="scratch directory (default: a new temp dir, removed afterwards)")
    args = p.parse_args(argv)
    if args.reshard is not None:
        parts = args.reshard.split(":")
        if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"--reshard: {args.reshard!r} is not SAVED:LOADED (two rank counts)")
    grid = grid_from(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # The library's per-save lines and botocore's credential notes would bury the sweep's progress.
    for name in ("uc_checkpoint", "botocore", "boto3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # DCP's note that a save without a process group is a single process's (the checkpoints sweep).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.update(FAKE_ENV)

    from .scale_report import update_main_report, write_scale_report

    work = Path(args.workdir or tempfile.mkdtemp(prefix="uc-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    data: dict[str, Any] = {"machine": machine(), "grid": grid, "quick": args.quick, "sweeps": list(args.only)}
    sweeps: dict[str, Callable[[], Any]] = {
        "ranks": lambda: sweep_ranks(work, grid, args.timeout),
        "size": lambda: sweep_size(work, grid, args.timeout, size_stores()),
        "tensors": lambda: sweep_tensors(
            work, grid, args.timeout, baseline=not (args.no_tensor_baseline or args.quick)
        ),
        "checkpoints": lambda: sweep_checkpoints(work, grid),
        "reshard": lambda: sweep_reshard(work, grid, args.timeout),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial.json")
    try:
        for name in SWEEPS:
            if name in args.only:
                data[name] = sweeps[name]()
                # A later sweep that fails (moto out of memory at 2 GiB) must not lose this one's figures.
                partial.write_text(json.dumps(data, indent=1))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    data["elapsed_s"] = round(time.monotonic() - started, 1)
    data["machine"]["load_average_end"] = round(os.getloadavg()[0], 2)
    out.write_text(json.dumps(data, indent=1))
    partial.unlink(missing_ok=True)
    report = Path(args.report)
    write_scale_report(data, report, plots_dir=out.parent)
    log.info("wrote %s, %s and plots under %s (%.0f s)", out, report, out.parent, data["elapsed_s"])
    if args.main_report:
        update_main_report(Path(args.main_report), data, report)
        log.info("updated the Scale section of %s", args.main_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
