"""Memory and time of ``export_checkpoint`` against its stated bound (docs/export.md, "Memory"),
for a checkpoint several times larger than the bound.

    python -m benchmarks.export --size-mib 1024 --out export.json

One process saves a checkpoint of ``--size-mib`` MiB (float32 tensors of ``--tensor-mib`` MiB each,
uniform random, ``UCVolumeWriter`` to a local directory). Each case then runs the export in a fresh
interpreter (so that nothing the parent allocated counts), which, once torch and uc_checkpoint are
imported, resets its peak-RSS counter (``/proc/self/clear_refs``, value 5) and samples its
anonymous memory (``RssAnon`` of ``/proc/self/status``) every 5 ms in a thread while the export runs.
Reported per case: the export's peak RSS above the RSS before it (``VmHWM`` after the reset), the
sampled peak of anonymous memory above the one before, the bound
(largest output file's tensors as stored, and again at the export dtype when converted, +
the reader's ``max_inflight_bytes``), seconds and
output bytes. The S3 case exports to a moto server running in the parent process, so the store's
memory is not the child's.

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.export")

MIB = 1 << 20
#: UCVolumeReader's default max_inflight_bytes (the export uses the reader's defaults).
READER_INFLIGHT_BYTES = 256 * MIB


def _status(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status``, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(args: dict[str, Any]) -> dict[str, Any]:
    """Run one export in this (fresh) process and measure it."""
    import torch.distributed.checkpoint  # noqa: F401 - imported before the baseline

    from uc_checkpoint.dcp.metadata_io import read_metadata
    from uc_checkpoint.ops.export import export_checkpoint, plan_export
    from uc_checkpoint.volumes import open_volume

    plan = plan_export(
        read_metadata(open_volume(args["checkpoint"])), dtype=args["dtype"], max_shard_bytes=args["max_shard_bytes"]
    )
    # A converted shard is held twice: as stored, then at the export dtype.
    largest_stored = max(
        sum(t.numel * t.stored_dtype.itemsize + (t.nbytes if t.dtype != t.stored_dtype else 0) for t in shard)
        for shard in plan.shards
    )
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    rss0, anon0 = _status("VmRSS"), _status("RssAnon")
    peak_anon = anon0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_anon
        while not done.wait(0.005):
            peak_anon = max(peak_anon, _status("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    options = {"endpoint_url": args["endpoint"], "addressing_style": "path"} if args.get("endpoint") else None
    started = time.monotonic()
    summary = export_checkpoint(
        args["checkpoint"],
        args["dest"],
        format=args["format"],
        dtype=args["dtype"],
        max_shard_bytes=args["max_shard_bytes"],
        volume_options=options,
    )
    seconds = time.monotonic() - started
    done.set()
    sampler.join()
    peak_anon = max(peak_anon, _status("RssAnon"))
    return {
        "files": len(summary.files),
        "output_bytes": summary.bytes,
        "seconds": round(seconds, 2),
        "largest_file_held_bytes": largest_stored,
        "bound_bytes": largest_stored + READER_INFLIGHT_BYTES,
        "peak_rss_above_start_bytes": _status("VmHWM") - rss0,
        "peak_anon_above_start_bytes": peak_anon - anon0,
    }


def _save(path: Path, size_bytes: int, tensor_bytes: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from uc_checkpoint import UCVolumeWriter

    g = torch.Generator().manual_seed(0)
    n = max(1, size_bytes // tensor_bytes)
    rows = tensor_bytes // (4 * 1024)
    state = {"model": {f"layers.{i}.weight": torch.rand(rows, 1024, generator=g) for i in range(n)}}
    dcp.save(state, storage_writer=UCVolumeWriter(path), no_dist=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="checkpoint size (MiB)")
    p.add_argument("--tensor-mib", type=int, default=16, help="size of each tensor (MiB)")
    p.add_argument("--workdir", help="where the checkpoint and exports go (default: a temp dir, removed)")
    p.add_argument("--no-s3", action="store_true", help="skip the case exporting to a moto S3 server")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        print(json.dumps(child(json.loads(ns.child))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(dir=ns.workdir) as tmp:
        root = Path(tmp)
        ckpt = root / "ckpt"
        _save(ckpt, ns.size_mib * MIB, ns.tensor_mib * MIB)
        cases: list[dict[str, Any]] = [
            {"format": "safetensors", "max_shard_bytes": 128 * MIB, "dtype": None},
            {"format": "torch", "max_shard_bytes": 128 * MIB, "dtype": None},
            {"format": "safetensors", "max_shard_bytes": 256 * MIB, "dtype": None},
            {"format": "safetensors", "max_shard_bytes": 128 * MIB, "dtype": "bfloat16"},
            {"format": "safetensors", "max_shard_bytes": 5 * 10**9, "dtype": None},  # one file
        ]
        results = []
        server = None
        if not ns.no_s3:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.support.s3_fixtures import moto_server, s3_client

            server = moto_server()
            endpoint = server.__enter__()
            s3_client(endpoint).create_bucket(Bucket="export-bench")
            cases.append(
                {"format": "safetensors", "max_shard_bytes": 128 * MIB, "dtype": None, "s3": True, "endpoint": endpoint}
            )
        try:
            for i, case in enumerate(cases):
                dest = f"s3://export-bench/out{i}" if case.get("s3") else str(root / f"out{i}")
                args = {**case, "checkpoint": str(ckpt), "dest": dest}
                env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.export", "--child", json.dumps(args)],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=False,
                )
                if out.returncode != 0:
                    raise SystemExit(f"case {case} failed: {out.stderr[-3000:]}")
                result = {
                    **{k: v for k, v in case.items() if k != "endpoint"},
                    **json.loads(out.stdout.splitlines()[-1]),
                }
                results.append(result)
                log.info(
                    "%-11s shard %5d MiB dtype %-8s %-5s: %2d files, peak RSS +%5.0f MiB, anon +%5.0f MiB, "
                    "bound %5.0f MiB, %.1f s",
                    case["format"],
                    case["max_shard_bytes"] // MIB,
                    case["dtype"] or "kept",
                    "s3" if case.get("s3") else "local",
                    result["files"],
                    result["peak_rss_above_start_bytes"] / MIB,
                    result["peak_anon_above_start_bytes"] / MIB,
                    result["bound_bytes"] / MIB,
                    result["seconds"],
                )
                if not case.get("s3"):
                    subprocess.run(["rm", "-rf", dest], check=True)
        finally:
            if server is not None:
                server.__exit__(None, None, None)
    report = {"checkpoint_bytes": ns.size_mib * MIB, "tensor_bytes": ns.tensor_mib * MIB, "cases": results}
    if ns.out:
        Path(ns.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
