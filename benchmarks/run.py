"""The checkpoint benchmark: uc_checkpoint against writing DCP shards straight onto a FUSE mount of the
store, and against the store's own limit, side by side in one run; writes the report.

    ./scripts/bench.sh                      # = python -m benchmarks.run (256 MiB, 1 and 2 ranks, 3 repeats)
    ./scripts/bench.sh --size-mb 1024 --kinds gpt small --repeats 5
    ./scripts/bench.sh --kinds gpt:256 gpt:1024 small:256   # a size per state-dict shape

It starts moto's S3 server on 127.0.0.1, mounts one of its buckets with s3fs-fuse (the stand-in for a
cloud volume's FUSE mount) and a local directory with bindfs (a local FUSE passthrough), then runs
every case of :mod:`benchmarks.case` in a fresh process (or torchrun job), the cases interleaved
repeat by repeat so that drift on the machine hits them alike:

==================  ===========================================================================
``uc-s3``           UCVolumeWriter/Reader to ``s3://`` (boto3)
``uc-s3-unsigned``  the same with ``S3Volume(sign_payload=False)``: SigV4 ``UNSIGNED-PAYLOAD``, as
                    s3torchconnector's CRT client signs (an option, measured beside the default)
``uc-s3fs``         UCVolumeWriter/Reader to the s3fs mount
``fs-s3fs``         DCP's FileSystemWriter/Reader directly on the s3fs mount (the baseline)
``uc-bindfs``       UCVolumeWriter/Reader to the bindfs mount
``fs-bindfs``       FileSystemWriter/Reader on the bindfs mount
``fs-local``        FileSystemWriter/Reader on local disk (upper bound)
``fsspec-s3``       DCP's FsspecWriter/Reader to ``s3://`` (when the ``s3fs`` Python package imports)
``s3tc``            s3torchconnector's S3StorageWriter/Reader (when it imports)
``boto3``           raw boto3 upload/download of the same bytes (the store's limit)
``dcp-floor``       DCP's own floor for an async save's blocked time: a FileSystemWriter to local
                    disk whose ``stage()`` is only the in-memory copy (``benchmarks.case``); run on
                    every store, so each section sets ours beside it in the same run
==================  ===========================================================================

Stores (``--stores``): every case runs against ``moto`` (the S3 server above, objects in memory and,
over 5 MiB, in temporary files; threads of this process). The direct-S3 cases (the headline rows:
``uc-s3`` and ``uc-s3-unsigned``, ``boto3`` with the naive staged path, ``s3tc``, ``fsspec-s3``)
also run against ``localbucket`` (PyPI, in the ``bench`` extra: a small disk-backed S3 server,
several times moto's download speed), started as a process of its own on a free port with a data
root under the scratch directory, so that the store's limits can be told apart from the clients'
costs. localbucket rejects keys ending in "/", so s3fs-fuse cannot mount it: the FUSE cases run on
moto only. Each result carries its ``store``; the report has a section per store.

Store CPU: ``store_cpu_s`` is the S3 server's user + system CPU over the whole case run (psutil on
its pid; moto's is this process's own, as moto runs in it and this process only waits meanwhile),
and the cases split it per timed call (``*_store_cpu_s``, see
:mod:`benchmarks.case`).

Results: ``docs/benchmarks.json`` (every run), ``docs/benchmarks.md`` (medians, the targets' ratios,
the machine) and ``docs/benchmarks/*.png``. Needs root for the FUSE mounts (s3fs and bindfs are
installed with apt-get when missing) and for dropping the page cache before each timed phase (see
:mod:`benchmarks.case`: every phase starts from one settled memory state).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .usage import STORE_PID_ENV, cpu_s

log = logging.getLogger("benchmarks.run")
REPO = Path(__file__).resolve().parent.parent
FUSE_BUCKET = "fusebench"
DIRECT_BUCKET = "directbench"

KINDS = ("gpt", "small")
CASES = (
    "uc-s3",
    "uc-s3-unsigned",
    "uc-s3fs",
    "fs-s3fs",
    "uc-bindfs",
    "fs-bindfs",
    "fs-local",
    "fsspec-s3",
    "s3tc",
    "boto3",
    "dcp-floor",
)
#: The cases that talk S3 directly (no FUSE mount, no local disk): the ones run on every store.
DIRECT_CASES = ("uc-s3", "uc-s3-unsigned", "fsspec-s3", "s3tc", "boto3")
#: Cases that use no store at all (local disk only), also run on every store: a figure each
#: store's section compares ours with.
STORELESS_CASES = ("dcp-floor",)
#: Ours on S3 also times an async save into the staging buffers its first one left (case.py, 2b).
KEPT_BUFFERS_CASES = ("uc-s3", "uc-s3-unsigned")
#: The cases run against localbucket too (every other case runs on moto only).
EVERY_STORE_CASES = DIRECT_CASES + STORELESS_CASES
STORES = ("moto", "localbucket")
#: Checkpoints up to this size (MiB) have each synchronous phase of a case run SMALL_CALLS times in
#: its process, the median kept (``benchmarks.case --calls``): their calls last a tenth of a second,
#: where this host's swings are tens of percent of one call.
SMALL_MB = 64
SMALL_CALLS = 5
# The fake credentials every case uses (neither server checks them); a developer's session token or
# profile must not mix with them.
_FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
_CLEARED_AWS = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE")


def case_env(endpoint_url: str, staging: Path, store_pid: int | None = None) -> dict[str, str]:
    """The environment every case process runs in: this checkout, the S3 server (its URL, the fake
    keys, and with ``store_pid`` the pid of its process for the store-CPU figures), one thread per op
    (the cases share the machine's cores), a staging directory of the run's own."""
    return {
        **{k: v for k, v in os.environ.items() if k not in _CLEARED_AWS},
        **_FAKE_AWS,
        "AWS_ENDPOINT_URL": endpoint_url,
        **({STORE_PID_ENV: str(store_pid)} if store_pid is not None else {}),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "UC_CHECKPOINT_STAGING_DIR": str(staging),
        "PYTHONWARNINGS": "ignore",
    }


def _importable(module: str) -> bool:
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, timeout=120)
    return proc.returncode == 0


def case_plan(name: str, run_id: str, dirs: dict[str, Path]) -> tuple[str, str, str]:
    """(case kind for benchmarks.case, --dest, --visible) of one named case."""
    if name == "uc-s3":
        return "uc", f"s3://{DIRECT_BUCKET}/{run_id}/uc", f"s3://{DIRECT_BUCKET}/{run_id}/uc/.metadata"
    if name == "uc-s3-unsigned":
        where = f"s3://{DIRECT_BUCKET}/{run_id}/ucu"
        return "uc-unsigned", where, f"{where}/.metadata"
    if name == "fsspec-s3":
        return "fsspec", f"s3://{DIRECT_BUCKET}/{run_id}/fsspec", f"s3://{DIRECT_BUCKET}/{run_id}/fsspec/.metadata"
    if name == "s3tc":
        return "s3tc", f"s3://{DIRECT_BUCKET}/{run_id}/s3tc", f"s3://{DIRECT_BUCKET}/{run_id}/s3tc/.metadata"
    if name == "boto3":
        return "boto3", f"s3://{DIRECT_BUCKET}/{run_id}/raw", ""
    if name == "dcp-floor":
        return "floor", str(dirs["local"] / run_id / "floor"), str(dirs["local"] / run_id / "floor" / ".metadata")
    kind, where = name.split("-")
    sub = f"{run_id}/{kind}"
    if where == "s3fs":
        return kind, str(dirs["s3fs"] / sub), f"s3://{FUSE_BUCKET}/{sub}/.metadata"
    if where == "bindfs":
        return kind, str(dirs["bindfs"] / sub), str(dirs["bind_src"] / sub / ".metadata")
    return kind, str(dirs["local"] / sub), str(dirs["local"] / sub / ".metadata")


def parse_kind(spec: str, default_mb: int) -> tuple[str, int]:
    """``"gpt"`` or ``"gpt:1024"`` -> (kind, size in MiB); raises argparse.ArgumentTypeError."""
    kind, sep, size = spec.partition(":")
    if kind not in KINDS or (sep and (not size.isdigit() or int(size) == 0)):
        raise argparse.ArgumentTypeError(
            f"--kinds: {spec!r} is not KIND or KIND:MIB with KIND one of {', '.join(KINDS)}"
        )
    return kind, int(size) if size else default_mb


def narrower_run(
    committed: Path, sets: list[tuple[str, int]], args: argparse.Namespace, cases: list[str], stores: list[str]
) -> str | None:
    """Why this run covers less than the one whose results are committed at ``committed`` (its
    sizes, ranks, cases, stores or repeats), or None when it covers as much (or nothing is
    committed): a quick check must not replace the report of a full run."""
    try:
        old = json.loads(committed.read_text())
        old_args = old["args"]
        old_sets = {parse_kind(k, old_args["size_mb"]) for k in old_args["kinds"]}
        old_cases = set(old_args["cases"]) - set(old.get("skipped_cases", []))
        old_stores, old_ranks, old_repeats = set(old_args["stores"]), set(old_args["ranks"]), old_args["repeats"]
    except (OSError, ValueError, KeyError, TypeError, argparse.ArgumentTypeError):
        return None
    missing = [
        ("sizes", sorted(f"{k}:{mb}" for k, mb in old_sets - set(sets))),
        ("ranks", sorted(map(str, old_ranks - set(args.ranks)))),
        ("cases", sorted(old_cases - set(cases))),
        ("stores", sorted(old_stores - set(stores))),
    ]
    gaps = [f"{what} {', '.join(names)}" for what, names in missing if names]
    if args.repeats < old_repeats:
        gaps.append(f"{args.repeats} repeats against {old_repeats}")
    return "; ".join(gaps) or None


def run_case(
    name: str,
    ranks: int,
    kind: str,
    size_mb: int,
    dirs: dict[str, Path],
    env: dict[str, str],
    timeout: float,
    store: str = "moto",
    calls: int = 1,
) -> list[dict[str, Any]]:
    """Run one case in a fresh process or torchrun job against ``store`` (whose server's pid is in
    ``env``), each of its synchronous phases ``calls`` times (medians kept); returns one result
    dict per rank, each with the store and its CPU over the run."""
    run_id = uuid.uuid4().hex[:10]
    case, dest, visible = case_plan(name, run_id, dirs)
    out = dirs["work"] / f"result-{run_id}.json"
    args = [
        "--case",
        case,
        "--dest",
        dest,
        "--kind",
        kind,
        "--size-mb",
        str(size_mb),
        "--out",
        str(out),
        "--timeout",
        str(timeout),
        "--calls",
        str(calls),
    ]
    if visible:
        args += ["--visible", visible]
    if name in KEPT_BUFFERS_CASES:
        args.append("--kept-buffers")
    if ranks == 1:
        cmd = [sys.executable, "-m", "benchmarks.case", *args]
    else:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        cmd = [torchrun, "--standalone", f"--nproc_per_node={ranks}", "-m", "benchmarks.case", *args]
    # moto serves from threads of this process (the pid is this one's), which only waits for the case
    # meanwhile; localbucket from its own.
    store_pid = int(env[STORE_PID_ENV])
    started, cpu0 = time.perf_counter(), cpu_s(store_pid)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout + 120)
    store_cpu_s = cpu_s(store_pid) - cpu0
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"benchmark case {name} ({ranks} ranks, {store}) failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    results = json.loads(out.read_text())
    for r in results:
        r["name"] = name
        r["store"] = store
        r["store_cpu_s"] = store_cpu_s
        r["wall_s"] = time.perf_counter() - started
    _clean_case(name, run_id, dirs, env, store)
    out.unlink()
    return results


def _clean_case(name: str, run_id: str, dirs: dict[str, Path], env: dict[str, str], store: str) -> None:
    """Delete what a case wrote (moto holds objects in memory and temporary files; disks are small)."""
    from tests.support.s3_fixtures import s3_client

    client = s3_client(env["AWS_ENDPOINT_URL"])
    for bucket in (DIRECT_BUCKET, FUSE_BUCKET) if name not in EVERY_STORE_CASES else (DIRECT_BUCKET,):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{run_id}/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys and store == "localbucket":
                for key in keys:  # localbucket has no DeleteObjects
                    client.delete_object(Bucket=bucket, Key=key["Key"])
            elif keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    for root in (dirs["bind_src"], dirs["local"]):
        shutil.rmtree(root / run_id, ignore_errors=True)


def host_facts() -> dict[str, Any]:
    """Where a benchmark ran: date, CPU model, cores, memory, kernel, Python and library versions."""
    import boto3
    import moto
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "boto3": boto3.__version__,
        "moto": moto.__version__,
    }


def machine(stores: list[str]) -> dict[str, Any]:
    """What the report says about where it ran: :func:`host_facts`, the FUSE client and the stores."""
    s3fs = subprocess.run(["s3fs", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    return {
        **host_facts(),
        "s3fs_fuse": s3fs,
        **({"localbucket": _localbucket_version()} if "localbucket" in stores else {}),
    }


def _localbucket_version() -> str:
    proc = subprocess.run(
        [sys.executable, "-c", "import localbucket; print(localbucket.__version__)"], capture_output=True, text=True
    )
    return proc.stdout.strip() or "?"


def _pick_stores(wanted: list[str] | None, why_not: Any) -> tuple[list[str], str]:
    """(stores to run, a line for the log and report or ""). ``wanted`` None: both stores when
    localbucket imports, else moto alone. ``why_not()``: None when localbucket can run, else why not;
    asking for localbucket by name when it cannot run is an error (SystemExit)."""
    if wanted is not None and "localbucket" not in wanted:
        return list(dict.fromkeys(wanted)), ""
    reason = why_not()
    if reason is None:
        return list(dict.fromkeys(wanted or STORES)), ""
    if wanted is not None:
        raise SystemExit(f"--stores localbucket: it cannot run here ({reason}); pip install localbucket")
    return ["moto"], f"localbucket store not run: it does not import here ({reason}); pip install localbucket"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=256, help="checkpoint size in MiB (default 256)")
    p.add_argument(
        "--kinds",
        nargs="+",
        default=["gpt"],
        metavar="KIND[:MIB]",
        help="state-dict shapes: gpt (model + AdamW), small (many 16 KiB tensors); "
        "KIND:MIB gives that shape its own size (default: --size-mb), e.g. gpt:256 gpt:1024",
    )
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2], help="world sizes (default 1 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument(
        "--stores",
        nargs="+",
        choices=STORES,
        help="S3 servers to run against (default: both when localbucket imports, else moto); "
        f"on localbucket only the direct-S3 and store-less cases run ({', '.join(EVERY_STORE_CASES)})",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one case may take")
    p.add_argument(
        "--calls",
        type=int,
        help=f"times each synchronous phase runs per case process, medians kept (default: {SMALL_CALLS} "
        f"for checkpoints up to {SMALL_MB} MiB, else 1)",
    )
    p.add_argument(
        "--report",
        help="where the report goes (its raw results beside it, .json). Default docs/benchmarks.md, "
        "unless this run covers less than the one committed "
        "there: then a scratch report in a new directory under the system's temp directory",
    )
    p.add_argument("--workdir", help="scratch directory (default: a new temp dir, removed afterwards)")
    args = p.parse_args(argv)
    if args.calls is not None and args.calls < 1:
        p.error("--calls must be >= 1")
    try:
        sets = [parse_kind(k, args.size_mb) for k in args.kinds]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # A plain `kill` must still unmount and stop the server: turn SIGTERM into SystemExit, which
    # unwinds the ExitStack below.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    from tests.support.s3_fixtures import moto_server

    from .mounts import bindfs_mount, ensure_fuse_tools, s3fs_mount
    from .report import write_report
    from .servers import localbucket_available, localbucket_process, make_bucket

    cases = [
        c
        for c in args.cases
        if not (c == "fsspec-s3" and not _importable("s3fs"))
        and not (c == "s3tc" and not _importable("s3torchconnector"))
    ]
    skipped = sorted(set(args.cases) - set(cases))
    if skipped:
        log.info("skipping %s: the package does not import in this environment", ", ".join(skipped))
    stores, store_note = _pick_stores(args.stores, localbucket_available)
    if store_note:
        log.info("%s", store_note)
    committed = REPO / "docs" / "benchmarks.md"
    if args.report is None:
        narrower = narrower_run(committed.with_suffix(".json"), sets, args, cases, stores)
        args.report = str(committed)
        if narrower:
            # A directory of its own per run: a second quick run must not overwrite the first.
            args.report = str(Path(tempfile.mkdtemp(prefix="uc-bench-partial-")) / "benchmarks.md")
            log.info(
                "this run covers less than the committed one (missing %s): its report goes to %s, "
                "not %s (pass --report to choose)",
                narrower,
                args.report,
                os.path.relpath(committed, REPO),
            )
    # FUSE mounts (and their tools) only for the cases that use them, which run on moto only.
    fuse = "moto" in stores and any(c not in EVERY_STORE_CASES for c in cases)
    if fuse:
        ensure_fuse_tools()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="uc-bench-"))
    results: list[dict[str, Any]] = []
    with ExitStack() as stack:
        if not args.workdir:
            stack.callback(shutil.rmtree, work, ignore_errors=True)  # last, after the unmounts
        dirs = {"work": work, "local": work / "local", "bind_src": work / "bind-src", "staging": work / "staging"}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        envs: dict[str, dict[str, str]] = {}
        if "moto" in stores:
            url = stack.enter_context(moto_server())
            make_bucket(url, FUSE_BUCKET)
            make_bucket(url, DIRECT_BUCKET)
            if fuse:
                dirs["s3fs"] = stack.enter_context(s3fs_mount(url, FUSE_BUCKET, work / "mnt-s3fs"))
                dirs["bindfs"] = stack.enter_context(bindfs_mount(dirs["bind_src"], work / "mnt-bindfs"))
            envs["moto"] = case_env(url, dirs["staging"], os.getpid())
        if "localbucket" in stores:
            lb_url, lb_pid = stack.enter_context(localbucket_process(work / "localbucket" / "data"))
            make_bucket(lb_url, DIRECT_BUCKET)
            envs["localbucket"] = case_env(lb_url, dirs["staging"], lb_pid)
        for repeat in range(args.repeats):
            for kind, size_mb in sets:
                for ranks in args.ranks:
                    for store in stores:
                        for name in (c for c in cases if store == "moto" or c in EVERY_STORE_CASES):
                            log.info(
                                "repeat %d/%d: %s on %s, %s %d MiB, %d rank(s)",
                                repeat + 1,
                                args.repeats,
                                name,
                                store,
                                kind,
                                size_mb,
                                ranks,
                            )
                            calls = args.calls or (SMALL_CALLS if size_mb <= SMALL_MB else 1)
                            for r in run_case(
                                name, ranks, kind, size_mb, dirs, envs[store], args.timeout, store, calls
                            ):
                                r["repeat"] = repeat
                                r["size_mb"] = size_mb
                                results.append(r)
    report = Path(args.report)
    # The results are committed: a report inside the checkout is recorded relative to it, not as
    # this machine's path.
    shown = os.path.relpath(report.resolve(), REPO) if report.resolve().is_relative_to(REPO.resolve()) else str(report)
    raw = {
        "machine": machine(stores),
        "args": {**vars(args), "report": shown, "stores": stores},
        "skipped_cases": skipped,
        "store_note": store_note,
        "results": results,
    }
    report.parent.mkdir(parents=True, exist_ok=True)
    report.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    write_report(raw, report)
    log.info("wrote %s", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
