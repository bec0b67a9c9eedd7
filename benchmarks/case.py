"""One benchmark case in a fresh process (so its peak memory is its own), one rank or many under
torchrun; writes one JSON result. Run by :mod:`benchmarks.run`::

    python -m benchmarks.case --case uc --dest s3://bench/uc/1 --visible s3://bench/uc/1/.metadata \\
        --kind gpt --size-mb 256 --out result.json

Cases (``--case``): a writer and reader pair of :mod:`benchmarks.clients` (``uc``, ``uc-unsigned``,
``fs``, ``floor``, ``fsspec``, ``s3tc``), or ``boto3``, the store's limit: the data files our writer
makes (the same object layout, staged to local disk untimed) uploaded and downloaded with boto3's
``upload_file`` / ``download_file`` (s3transfer), 4 files at a time, as our writer does. The same
process also times the **naive staged path**: a sync ``FileSystemWriter`` save to local disk with as
many files as ours, then those files uploaded the same way, one after the other (no overlap), then
its ``.metadata`` (last, as a checkpoint is published); its load downloads them and ``.metadata``
and runs ``FileSystemReader`` on the local copy.

Client CPU: ``*_cpu_s`` fields are the user + system seconds of the case's process (all its threads)
over each timed call; the S3 server runs in another process (moto as threads of the runner,
localbucket on its own), so its CPU is not counted there. ``*_store_cpu_s`` fields are the S3
server's CPU over the same calls (user + system seconds of the process whose pid the runner passes in
``UC_BENCH_STORE_PID``; in a multi-rank run every rank reads the same server over about the same
window, so the report takes the largest rank's figure, not their sum).

Every case first runs each kind of transfer it times once, untimed (step 0 below; the boto3 case
its upload, its download and both halves of the naive path), so that the figures are a running
job's, with its code and clients warm, not a cold process's: botocore reads its service models
once per process (~0.1 s of CPU), clients and connections are built once, and after the page-cache
drop before each phase (below) the first run of code the process has not run yet reads it back from
disk, up to 8 MiB per page fault with this VM's readahead (measured: a process's first load after a
drop read 11.4 MB in 3 major faults, 10-15 ms at 32 MiB, while raw boto3's download, timed after
its own upload, read 0.15 MB). The async save and the in-memory copy it is compared with are
warmed on a tiny state (two 256 KiB tensors, ``_tiny_state``) only: the copy is timed first thing in
the process on fresh memory, and a warm-up of the real size would leave freed memory for the timed
one to reuse (a copy into reused memory takes about half the time). Without their warm-ups both
read code back from disk: a process's first 32 MiB copy took 8.3-9.0 ms against 7.7-7.9 after a
warm one, and an async save's stage ran its first allocation of each tensor ~1 ms slower.

With ``--calls N`` (the runner passes 5 for checkpoints up to 64 MiB) the synchronous save, the load,
and the boto3 case's upload, download and both halves of the naive path each run N times in the
process, each call from its own settled memory state (below), the saves to N locations; every figure is its
median over the calls (``_timed_calls``). Peak memory is the highest over the calls. The async
save runs once.

Every case first times a plain in-memory copy of the state dict (the floor for any async save's
blocked time). Save cases then measure, in this order:

0. an untimed ``dcp.save`` to ``<dest>-warmup`` (see above; its untimed load comes before step 3),
   then an untimed ``dcp.async_save`` of the tiny state to ``<dest>-warmup-async``;
1. a synchronous ``dcp.save`` to ``<dest>-sync``: peak extra memory (VmHWM above the RSS before the
   save; ``/proc/self/clear_refs`` resets the high-water mark) with no staging copy involved;
2. ``dcp.async_save`` (THREAD) to ``<dest>``: ``blocked_s`` (until async_save returns: training is
   blocked that long) and ``publish_s`` (until ``--visible``, the ``.metadata`` object or file on the
   volume itself, exists; polled every 5 ms by rank 0), then waits for the future; ours
   (with ``--kept-buffers``) with a :class:`~uc_checkpoint.StagingBuffers`, empty before this save;
2b. ours with ``--kept-buffers`` (the direct-S3 cases): ``dcp.async_save`` again to ``<dest>-kept`` with the same buffers, which the save
   of step 2 filled: ``blocked_kept_s`` (what ``CheckpointManager(staging=Staging(reuse_buffers=True))``
   blocks from its second save on); the buffers are freed after it;
3. ``dcp.load`` into zeros: ``load_s``, and the loaded state is compared with what was saved,
   tensor by tensor (a mismatch fails the case).

Every timed phase of every case (the in-memory copy, each call of a save, upload, download or
load, and the async save) starts from the same memory state (``_settle``): the page cache dropped
(when root; ``_drop_page_cache``), then three times the rank's share of the checkpoint touched and
freed by a child process (``_preheat``, at most half the memory available; a phase's new memory
is at most a staged copy, its staged files and the store's copy). Both matter on this VM, which hands memory the guest freed more than
~2 s before back to its host (virtio-balloon free page reporting); touching such memory again
costs host page faults that the guest counts as the toucher's CPU (measured: 4 GiB touched right
after 4 GiB were freed, 0.8-0.9 s; 5-10 s after, 3.4-3.6 s). Memory freed just before a phase is
taken first by the phase's allocations, so what a phase costs depended on what freed memory
preceded it: a write into the page cache with no drop before it cost about twice the CPU, in the
writing client and in the store alike (localbucket, 242 MiB: store 0.85 against 0.46 CPU-s, the
naive path's client 1.0 against 0.7); the async save, once timed without a drop, reached
``.metadata`` in 1.2-1.8 s at 256 MiB on localbucket against 0.55-0.65 s for the synchronous
save before it (client and store each at twice the CPU); and after a drop alone a copy into new
memory took either its usual time or about half (256 MiB: 0.059 or 0.026 s), as the drop had freed
enough or not. Settled, every phase allocates memory its host backs, as on a host that keeps freed
memory (bare metal, or a VM without such a balloon). The copy's tiny warm-up runs after its
settle (a drop can take code the process has not run yet); the async save's ran earlier, and its
blocked time settled matched the copy's (256 MiB on localbucket, three runs: 0.053-0.055 s against
0.053-0.056 s).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from . import clients, state
from .usage import cpu_s, peak_rss_above, reset_peak_rss, rss_bytes, store_cpu_s

POLL_S = 0.005
#: Memory touched and freed before each timed phase, in multiples of the rank's share of the
#: checkpoint: the most new memory a phase takes (a staged copy, staged files, the store's copy).
HEAT_FACTOR = 3
_PREHEAT = "import mmap, sys; mmap.mmap(-1, int(sys.argv[1]), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE).close()"


def _put_store_cpu(out: dict[str, Any], key: str, before: float | None) -> None:
    """``out[key]``: the S3 server's CPU seconds since ``before`` (when the runner named it)."""
    after = store_cpu_s()
    if before is not None and after is not None:
        out[key] = after - before


def _drop_page_cache() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3")
    except OSError:
        pass  # not root: phases then run from whatever the page cache holds


def _preheat(nbytes: int) -> None:
    """Touch ``nbytes`` of anonymous memory and free it again, so that the phase that follows
    allocates memory this VM's host already backs (see the module docstring: memory the guest freed
    more than ~2 s ago is handed back to the host, and touching it again costs ~0.7 CPU-s/GiB)."""
    # At most half the memory available, so that a large checkpoint on a small host is settled
    # less, not killed for memory.
    nbytes = min(nbytes, _available_bytes() // 2)
    if nbytes > 0:
        # In a child process, so that this process's peak memory (VmHWM) stays its phases' own.
        subprocess.run([sys.executable, "-S", "-c", _PREHEAT, str(nbytes)], check=True)


def _available_bytes() -> int:
    """The kernel's estimate of memory available without swapping (``MemAvailable``), in bytes;
    very large when it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def _settle(heat: int) -> None:
    """The memory state every timed phase starts from: page cache dropped, then ``heat`` bytes of
    memory touched and freed (:func:`_preheat`)."""
    _drop_page_cache()
    _preheat(heat)


@contextmanager
def _timed(out: dict[str, Any], name: str, heat: int = 0) -> Iterator[None]:
    """Time the body as phase ``name``: ``out[name + "_s"]`` (wall), ``name + "_cpu_s"`` (this
    process) and ``name + "_store_cpu_s"`` (the S3 server, when named). The clock starts once the
    memory is settled (:func:`_settle` with ``heat`` bytes) and every rank is there, so every phase
    runs from the same page-cache and memory state (see the module docstring)."""
    _settle(heat)
    if dist.is_initialized():
        dist.barrier()
    t0, c0, s0 = time.perf_counter(), cpu_s(), store_cpu_s()
    yield
    out[f"{name}_s"], out[f"{name}_cpu_s"] = time.perf_counter() - t0, cpu_s() - c0
    _put_store_cpu(out, f"{name}_store_cpu_s", s0)


def _timed_calls(out: dict[str, Any], name: str, calls: int, call: Callable[[int], object], heat: int = 0) -> None:
    """Phase ``name`` as :func:`_timed`, run ``calls`` times (``call(i)`` for the i-th, from 0):
    ``out`` gets the median of each figure over the calls, and ``name + "_calls"``. A call of a
    tenth of a second on this shared 2-core host swings by tens of percent from one to the next
    (a 30 MiB upload to the same store took 0.07-0.34 s in six calls in a row), so small
    checkpoints are timed several times per process (see ``--calls``)."""
    runs: list[dict[str, Any]] = []
    for i in range(calls):
        one: dict[str, Any] = {}
        with _timed(one, name, heat):
            call(i)
        runs.append(one)
    for key in runs[0]:
        out[key] = statistics.median(run[key] for run in runs)
    out[f"{name}_calls"] = calls


def _exists(url: str) -> Callable[[], bool]:
    """A cheap probe for one object or file on the volume itself (not through a mount)."""
    if url.startswith("s3://"):
        import boto3

        bucket, _, key = url[5:].partition("/")
        client = boto3.client("s3")

        def probe() -> bool:
            try:
                client.head_object(Bucket=bucket, Key=key)
                return True
            except client.exceptions.ClientError:
                return False

        return probe
    return lambda: os.path.exists(url)


def _tiny_state() -> dict[str, Any]:
    """A state dict of two 256 KiB tensors (above ATen's grain, so torch copies them as it copies
    the real state's): big enough to run the code a copy or an async save runs, too small for the
    memory it frees to serve the timed ones (see the module docstring)."""
    return {"model": {"w": torch.ones(1 << 16)}, "optim": {"m": torch.ones(1 << 16)}, "step": 1}


def _heat(sd: Any) -> int:
    """Bytes :func:`_settle` touches before a phase on the state dict ``sd``."""
    return HEAT_FACTOR * state.nbytes(sd)


def _timed_copy(sd: Any) -> float:
    _settle(_heat(sd))
    state.cpu_copy(_tiny_state())  # the copy's code warm, as every timed call's (module docstring)
    t0 = time.perf_counter()
    copy = state.cpu_copy(sd)
    elapsed = time.perf_counter() - t0
    del copy
    gc.collect()
    return elapsed


def run_save_load(args: argparse.Namespace, sd: Any, mesh: Any, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 0. one untimed save of the same state elsewhere (its load comes in 3): clients, connections
    # and code paths warm, as run_boto3 warms its transfers (see the module docstring); and an
    # untimed async save of a tiny state, for the code async_save runs and a save does not.
    dcp.save(sd, storage_writer=clients.writer(args.case, args.dest + "-warmup"), planner=clients.planner(args.case))
    tiny = dcp.async_save(
        _tiny_state(),
        storage_writer=clients.writer(args.case, args.dest + "-warmup-async"),
        planner=clients.planner(args.case),
    )
    (tiny.upload_completion if hasattr(tiny, "upload_completion") else tiny).result()
    # 1. synchronous save: memory without a staging copy
    gc.collect()
    base = rss_bytes()
    reset_peak_rss()
    _timed_calls(
        out,
        "sync_save",
        args.calls,
        lambda i: dcp.save(
            sd,
            storage_writer=clients.writer(args.case, args.dest + "-sync" + (f"{i}" if i else "")),
            planner=clients.planner(args.case),
        ),
        _heat(sd),
    )
    out["sync_peak_extra_bytes"] = peak_rss_above(base)

    # 2. async save: blocked time and time until .metadata is on the volume, from the memory state
    # of every other phase (and of the copy it is compared with), see the module docstring.
    probe = _exists(args.visible) if rank == 0 else None
    gc.collect()
    _settle(_heat(sd))
    if dist.is_initialized():
        dist.barrier()
    base = rss_bytes()
    reset_peak_rss()
    # Ours keeps its snapshot's memory for 2b (a first save with StagingBuffers allocates as
    # without them: the set is empty).
    buffers = clients.staging_buffers(args.case) if args.kept_buffers else None
    t0 = time.perf_counter()
    fut = dcp.async_save(
        sd, storage_writer=clients.writer(args.case, args.dest, buffers), planner=clients.planner(args.case)
    )
    out["blocked_s"] = time.perf_counter() - t0
    if probe is not None:
        deadline = t0 + args.timeout
        while not probe():
            if time.perf_counter() > deadline:
                raise SystemExit(f"{args.visible} did not appear within {args.timeout} s")
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
            time.sleep(POLL_S)
        out["publish_s"] = time.perf_counter() - t0
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()  # uploads included
    out["async_done_s"] = time.perf_counter() - t0
    out["async_peak_extra_bytes"] = peak_rss_above(base)
    if buffers is not None:
        # 2b. ours again, copying into the kept buffers: CheckpointManager(staging=Staging(reuse_buffers=True))
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(
            sd,
            storage_writer=clients.writer(args.case, args.dest + "-kept", buffers),
            planner=clients.planner(args.case),
        )
        out["blocked_kept_s"] = time.perf_counter() - t0
        fut.result()
        buffers.clear()
        gc.collect()

    # 3. load into zeros and compare, after an untimed load of step 0's checkpoint (not before the
    # saves: its freed memory would serve their allocations, not the in-memory copy's)
    if dist.is_initialized():
        dist.barrier()
    dcp.load(
        state.build(args.kind, args.size_mb << 20, mesh, zeros=True),
        storage_reader=clients.reader(args.case, args.dest + "-warmup"),
    )
    target = state.build(args.kind, args.size_mb << 20, mesh, zeros=True)
    gc.collect()
    base = rss_bytes()
    reset_peak_rss()
    _timed_calls(
        out,
        "load",
        args.calls,
        lambda i: dcp.load(target, storage_reader=clients.reader(args.case, args.dest)),
        _heat(sd),
    )
    out["load_peak_extra_bytes"] = peak_rss_above(base)
    state.assert_equal(sd, target)
    out["verified"] = True
    return out


def run_boto3(args: argparse.Namespace, sd: Any, mesh: Any, rank: int) -> dict[str, Any]:
    """Raw boto3 transfers of the files our writer makes (staged to local disk, untimed), then the
    naive staged path (see the module docstring)."""
    import tempfile

    import boto3
    from boto3.s3.transfer import TransferConfig

    from uc_checkpoint import UCVolumeWriter
    from uc_checkpoint.volumes.s3 import DEFAULT_MAX_CONCURRENCY, DEFAULT_MULTIPART_THRESHOLD, DEFAULT_PART_SIZE

    bucket, _, prefix = args.dest[5:].partition("/")
    client = boto3.client("s3")
    config = TransferConfig(
        multipart_threshold=DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunksize=DEFAULT_PART_SIZE,
        max_concurrency=DEFAULT_MAX_CONCURRENCY,
    )

    def upload(files: list[Path], key_prefix: str) -> None:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: client.upload_file(str(p), bucket, f"{key_prefix}/{p.name}", Config=config), files))

    def download(files: list[Path], key_prefix: str, into: Path) -> None:
        into.mkdir(exist_ok=True)
        with ThreadPoolExecutor(4) as pool:
            list(
                pool.map(
                    lambda p: client.download_file(bucket, f"{key_prefix}/{p.name}", str(into / p.name), Config=config),
                    files,
                )
            )

    def rank_files(directory: Path) -> list[Path]:
        """This rank's data files in a checkpoint directory, by name."""
        return sorted(p for p in directory.iterdir() if p.suffix == ".distcp" and p.name.startswith(f"__{rank}_"))

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("UC_CHECKPOINT_STAGING_DIR")) as mine:
        # One directory for all ranks (rank 0's), as one checkpoint location on a shared disk.
        shared = [mine]
        if dist.is_initialized():
            dist.broadcast_object_list(shared, src=0)
        tmp = shared[0]
        # Raw boto3 on our object layout: stage with our writer to a local directory (untimed).
        src = Path(tmp) / "src"
        dcp.save(sd, storage_writer=UCVolumeWriter(str(src)))
        files = rank_files(src)
        out["file_bytes"] = sum(p.stat().st_size for p in files)
        out["files"] = len(files)
        # Untimed, as every case's step 0: each transfer and each half of the naive path once.
        upload(files, f"{prefix}-warmup")
        download(files, f"{prefix}-warmup", Path(tmp) / f"warm{rank}")
        shutil.rmtree(Path(tmp) / f"warm{rank}")
        warm = str(Path(tmp) / "naive-warmup")  # all ranks', as the naive path's below
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(warm, thread_count=max(1, len(files))))
        heat = _heat(sd)
        _timed_calls(out, "upload", args.calls, lambda i: upload(files, prefix + (f"-{i}" if i else "")), heat)
        _timed_calls(out, "download", args.calls, lambda i: download(files, prefix, Path(tmp) / f"dst{rank}-{i}"), heat)
        for i in range(args.calls):
            for p in files:
                assert (Path(tmp) / f"dst{rank}-{i}" / p.name).read_bytes() == p.read_bytes(), f"{p.name} differs"

        # The naive staged path: stock writer to local disk with as many files, then upload them.
        def naive_save(i: int) -> None:
            naive, naive_prefix = Path(tmp) / f"naive{i}", f"{prefix}-naive{i}"
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(naive), thread_count=max(1, len(files))))
            upload(rank_files(naive), naive_prefix)
            barrier()
            if rank == 0:  # last, once every rank's data is up, as a checkpoint is published
                client.upload_file(str(naive / ".metadata"), bucket, f"{naive_prefix}/.metadata")
            barrier()

        _timed_calls(out, "naive_save", args.calls, naive_save, heat)
        naive_prefix = f"{prefix}-naive0"
        naive_files = rank_files(Path(tmp) / "naive0")
        dcp.load(
            state.build(args.kind, args.size_mb << 20, mesh, zeros=True), storage_reader=dcp.FileSystemReader(warm)
        )
        target = state.build(args.kind, args.size_mb << 20, mesh, zeros=True)

        def naive_load(i: int) -> None:
            local = Path(tmp) / f"naive-dst{i}"  # all ranks', as the naive path's save
            download(naive_files, naive_prefix, local)
            if rank == 0:
                client.download_file(bucket, f"{naive_prefix}/.metadata", str(local / ".metadata"))
            barrier()
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(local)))

        _timed_calls(out, "naive_load", args.calls, naive_load, heat)
        state.assert_equal(sd, target)
        barrier()  # rank 0 removes the shared directory on leaving
    out["verified"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.case", description=__doc__.split("\n\n")[0])
    p.add_argument("--case", required=True, choices=(*clients.CASES, "boto3"))
    p.add_argument("--dest", required=True, help="checkpoint location (path or URL)")
    p.add_argument("--visible", help="the .metadata object/file on the volume itself (s3://... or a path)")
    p.add_argument("--kind", default="gpt", choices=("gpt", "small"))
    p.add_argument("--size-mb", type=int, default=256, help="checkpoint size in MiB (all ranks together)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument(
        "--kept-buffers",
        action="store_true",
        help="ours: also time an async save into the staging buffers the first one left (step 2b)",
    )
    p.add_argument(
        "--calls",
        type=int,
        default=1,
        help="times each synchronous save, load, upload and download phase runs in this process; "
        "its figures are the medians over them (the async save runs once)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error("--calls must be >= 1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))

    mesh = None
    rank = 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = state.build(args.kind, args.size_mb << 20, mesh)
    result: dict[str, Any] = {
        "case": args.case,
        "kind": args.kind,
        "size_mb": args.size_mb,
        "ranks": dist.get_world_size() if dist.is_initialized() else 1,
        "rank_bytes": state.nbytes(sd),
        "memcopy_s": _timed_copy(sd),
    }
    if args.case == "boto3":
        result.update(run_boto3(args, sd, mesh, rank))
    else:
        result.update(run_save_load(args, sd, mesh, rank))
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
    else:
        gathered = [result]
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
