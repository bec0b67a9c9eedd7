"""One point of the scale benchmark (:mod:`benchmarks.scale`) in a fresh process, one rank or many under
torchrun; writes one JSON list (one dict per rank)::

    python -m benchmarks.scale_case --dest s3://bench/x --state gpt --size-mb 64 --out r.json
    torchrun --standalone --nproc_per_node 4 -m benchmarks.scale_case --dest s3://bench/x --phase save ...

Phases (``--phase``): ``save`` (a synchronous ``dcp.save``), ``load`` (``dcp.load`` into zeros,
compared with what was saved, tensor by tensor), ``both`` (save, then load). Between the two, rank 0
sends one ``HEAD`` of :data:`PHASE_MARK` through ``AWS_ENDPOINT_URL``, so that a request counter on
that endpoint (the fault proxy) can tell the save's requests from the load's.

State (``--state``): ``gpt`` (:func:`benchmarks.state.build`, each rank generating its own shard),
``global`` (the 1-rank ``gpt`` state generated whole on every rank and cut into this world's Shard(0)
pieces: the same checkpoint content for any world size, so a load by another world size can be
checked), ``tensors`` (``--tensors`` float32 tensors of equal size under one ``"model"`` key, ``--size-mb``
in all: :mod:`benchmarks.state`'s ``equal``).

Measures per rank: ``save_s`` / ``load_s`` (wall, after a barrier), ``save_cpu_s`` / ``load_cpu_s``
(user + system seconds of this process, all threads; the S3 server runs elsewhere), and on rank 0
``publish_s`` (until ``.metadata`` exists on the store, polled every 5 ms through ``--probe-endpoint``
so that the polls are not counted) and ``files_per_rank`` (data files of each rank at the location).
With ``--raw-download`` (1 rank), ``raw_download_s``: boto3 downloading the same data objects, the
store's own pace.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from . import clients, state
from .usage import cpu_s

#: The key rank 0 looks up between the save and the load (see the module docstring).
PHASE_MARK = "__scale_phase_mark__"
POLL_S = 0.005


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://") :].partition("/")
    return bucket, key


def _client(endpoint: str | None) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))


def build(args: argparse.Namespace, mesh: Any, *, zeros: bool) -> Any:
    if args.state == "gpt":
        return state.build("gpt", args.size_mb << 20, mesh, zeros=zeros)
    if args.state == "global":
        if zeros:
            return state.build("gpt", args.size_mb << 20, mesh, zeros=True)
        return state.shard(state.build("gpt", args.size_mb << 20, None), mesh)
    return state.build("equal", args.size_mb << 20, mesh, zeros=zeros, tensors=args.tensors)


def _probe(args: argparse.Namespace, t0_box: list[float], out: dict[str, Any], stop: threading.Event) -> None:
    """Rank 0: note when ``.metadata`` appears on the store (polled directly, not through the proxy)."""
    client = _client(args.probe_endpoint)
    bucket, key = _split(args.dest.rstrip("/") + "/.metadata")
    while not stop.is_set():
        try:
            client.head_object(Bucket=bucket, Key=key)
            out["publish_s"] = time.perf_counter() - t0_box[0]
            return
        except client.exceptions.ClientError:
            time.sleep(POLL_S)


def save(args: argparse.Namespace, sd: Any, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.dest.startswith("s3://") and args.writer == "uc":
        # Build the store client before timing (botocore reads its models once per process), as a
        # running job's saves find it built.
        from uc_checkpoint.volumes import open_volume

        open_volume(args.dest).client  # noqa: B018 - built for its side effect
    gc.collect()
    _barrier()
    t0_box = [time.perf_counter()]
    stop = threading.Event()
    probe = None
    if rank == 0 and args.probe_endpoint:
        probe = threading.Thread(target=_probe, args=(args, t0_box, out, stop), daemon=True)
        probe.start()
    t0_box[0] = t0 = time.perf_counter()
    c0 = cpu_s()
    dcp.save(sd, storage_writer=clients.writer(args.writer, args.dest), planner=clients.planner(args.writer))
    out["save_s"] = time.perf_counter() - t0
    out["save_cpu_s"] = cpu_s() - c0
    if probe is not None:
        probe.join(timeout=30)
        stop.set()
    _barrier()
    if rank == 0:
        out["files_per_rank"] = _files_per_rank(args)
    return out


def _files_per_rank(args: argparse.Namespace) -> dict[str, int]:
    """Data files (``__<rank>_*.distcp``) per rank at the location, listed directly (not counted)."""
    if args.dest.startswith("s3://"):
        client = _client(args.probe_endpoint or None)
        bucket, key = _split(args.dest.rstrip("/") + "/")
        names = [
            o["Key"].rsplit("/", 1)[-1]  # a data file may sit under a sub-prefix
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
            for o in page.get("Contents", [])
        ]
    else:
        names = os.listdir(args.dest)
    counts: dict[str, int] = {}
    for name in names:
        if name.startswith("__") and name.endswith(".distcp"):
            owner = name[2:].split("_", 1)[0]
            counts[owner] = counts.get(owner, 0) + 1
    return counts


def mark_phase(args: argparse.Namespace) -> None:
    """One HEAD through AWS_ENDPOINT_URL that a request counter sees between the two phases."""
    if not args.dest.startswith("s3://"):
        return
    client = _client(os.environ.get("AWS_ENDPOINT_URL"))
    bucket, _ = _split(args.dest)
    try:
        client.head_object(Bucket=bucket, Key=PHASE_MARK)
    except client.exceptions.ClientError:
        pass  # a 404 is expected: the request itself is the mark


def load(args: argparse.Namespace, expected: Any, mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    target = build(args, mesh, zeros=True)
    gc.collect()
    _barrier()
    t0, c0 = time.perf_counter(), cpu_s()
    dcp.load(target, storage_reader=clients.reader(args.writer, args.dest))
    out["load_s"] = time.perf_counter() - t0
    out["load_cpu_s"] = cpu_s() - c0
    state.assert_equal(expected, target)
    out["verified"] = True
    return out


class _Discard:
    """A file-like sink for downloads that are timed, not kept."""

    def write(self, data: bytes) -> int:
        return len(data)


def raw_download(args: argparse.Namespace) -> dict[str, Any]:
    """The store's limit for the load: boto3's ``download_fileobj`` of the checkpoint's data objects
    (the same objects the load read), 4 at a time, with our S3 defaults for parts and concurrency."""
    from boto3.s3.transfer import TransferConfig

    from uc_checkpoint.volumes.s3 import DEFAULT_MAX_CONCURRENCY, DEFAULT_MULTIPART_THRESHOLD, DEFAULT_PART_SIZE

    client = _client(os.environ.get("AWS_ENDPOINT_URL"))
    bucket, key = _split(args.dest.rstrip("/") + "/")
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
        for o in page.get("Contents", [])
        if o["Key"].endswith(".distcp")
    ]
    config = TransferConfig(
        multipart_threshold=DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunksize=DEFAULT_PART_SIZE,
        max_concurrency=DEFAULT_MAX_CONCURRENCY,
    )
    t0, c0 = time.perf_counter(), cpu_s()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda k: client.download_fileobj(bucket, k, _Discard(), Config=config), keys))
    return {"raw_download_s": time.perf_counter() - t0, "raw_download_cpu_s": cpu_s() - c0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_case", description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", required=True)
    p.add_argument("--phase", choices=("save", "load", "both"), default="both")
    p.add_argument("--state", choices=("gpt", "global", "tensors"), default="gpt")
    p.add_argument("--size-mb", type=int, default=64, help="checkpoint size in MiB, all ranks together")
    p.add_argument("--tensors", type=int, default=100, help="number of tensors (--state tensors)")
    p.add_argument("--writer", choices=("uc", "fs"), default="uc", help="uc: ours; fs: DCP's FileSystemWriter")
    p.add_argument("--probe-endpoint", default="", help="S3 endpoint for the uncounted .metadata probe and listing")
    p.add_argument("--raw-download", action="store_true", help="also time boto3 downloading the data objects (1 rank)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh, rank = None, 0
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (world,))
    sd = build(args, mesh, zeros=False)
    result: dict[str, Any] = {"rank": rank, "ranks": world, "rank_bytes": state.nbytes(sd)}
    if args.phase in ("save", "both"):
        result.update(save(args, sd, rank))
    if args.phase == "both":
        _barrier()
        if rank == 0:
            mark_phase(args)
        _barrier()
    if args.phase in ("load", "both"):
        result.update(load(args, sd, mesh))
    if args.raw_download and rank == 0:
        result.update(raw_download(args))
    if dist.is_initialized():
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
    else:
        gathered = [result]
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
