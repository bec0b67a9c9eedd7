"""What compression costs and saves, beside the plain save: the same state dict saved by
``UCVolumeWriter`` to a local directory, plain and with DCP's ``ZStandard`` stream extension
(``_extensions=[ZStandard()]``), then loaded back by ``UCVolumeReader`` and compared.

    python -m benchmarks.compression --size-mb 64 --out compression.json

Per variant it records the bytes on the volume (the data files and ``.metadata``, as listed after
the save) and, per synchronous ``dcp.save`` and ``dcp.load``, the wall seconds and this process's
client CPU seconds (user + system, all threads: serialising, compressing, the local copy to the
volume, checksums). A local directory, not an S3 server, so that no store's CPU runs in the
measured process and the difference between the variants is the client's work alone; the bytes
on the volume are what an upload to any store would move. Each call starts from the memory state
:mod:`benchmarks.case` settles every timed phase to, and the variants alternate call by call (so
drift on the host hits both alike); every figure is the median over ``--calls``. One untimed save
and load of each variant comes first (templates, compressor and code warm).

The ``gpt`` state (:mod:`benchmarks.state`) is uniform random float32 in [0, 1): like trained weights
and optimiser moments, its mantissas do not compress and only the narrow exponents do, so the ratio
is an honest floor for real checkpoints; the ``zeros`` kind (the same shapes, all zero) is the
other end.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard

from uc_checkpoint import UCVolumeReader, UCVolumeWriter

from . import state
from .case import HEAT_FACTOR, _timed

log = logging.getLogger("benchmarks.compression")

VARIANTS = ("plain", "zstd")


def _extensions(variant: str) -> list[Any] | None:
    return [ZStandard()] if variant == "zstd" else None


def _build(kind: str, size_bytes: int, *, target: bool) -> dict[str, Any]:
    """The saved state (``target`` False) or a load target of its structure; ``zeros`` is the
    ``gpt`` shapes all zero (its load target too: the comparison is of values)."""
    if kind == "zeros":
        return state.build("gpt", size_bytes, zeros=True)
    return state.build(kind, size_bytes, zeros=target)


def _stored_bytes(dest: Path) -> int:
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())


def measure(kind: str, size_mb: int, calls: int, work: Path) -> dict[str, Any]:
    """Save and load a ``kind`` state of ``size_mb`` MiB ``calls`` times per variant under ``work``;
    returns ``{"kind", "size_mb", "state_bytes", "calls", "plain": {...}, "zstd": {...}}`` with each
    variant's ``stored_bytes``, ``save_s``, ``save_cpu_s``, ``load_s``, ``load_cpu_s`` (medians)."""
    sd = _build(kind, size_mb << 20, target=False)
    nbytes = state.nbytes(sd)
    heat = HEAT_FACTOR * nbytes
    staging = work / "staging"
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}

    def save(variant: str, dest: Path) -> None:
        dcp.save(sd, storage_writer=UCVolumeWriter(dest, staging_dir=staging, _extensions=_extensions(variant)))

    def load(dest: Path) -> Any:
        target = _build(kind, size_mb << 20, target=True)
        dcp.load(target, storage_reader=UCVolumeReader(dest, staging_dir=staging))
        return target

    for variant in VARIANTS:  # warm-up, untimed
        save(variant, work / f"warmup-{variant}")
        state.assert_equal(load(work / f"warmup-{variant}"), sd)
        shutil.rmtree(work / f"warmup-{variant}")
    for i in range(calls):
        for variant in VARIANTS:
            one: dict[str, Any] = {}
            dest = work / f"{variant}-{i}"
            with _timed(one, "save", heat):
                save(variant, dest)
            one["stored_bytes"] = _stored_bytes(dest)
            loaded: list[Any] = []
            with _timed(one, "load", heat):
                loaded.append(load(dest))
            state.assert_equal(loaded[0], sd)
            shutil.rmtree(dest)
            runs[variant].append(one)
    out: dict[str, Any] = {"kind": kind, "size_mb": size_mb, "state_bytes": nbytes, "calls": calls}
    for variant, results in runs.items():
        out[variant] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    return out


def describe(result: dict[str, Any]) -> str:
    """The result as a few lines: bytes on the volume and client CPU, zstd beside plain."""
    plain, zstd = result["plain"], result["zstd"]
    lines = [
        f"{result['kind']} state, {result['state_bytes'] / 2**20:.1f} MiB of tensors, median of {result['calls']} call(s):",
        f"  {'':6} {'stored MiB':>10} {'save s':>8} {'save CPU-s':>10} {'load s':>8} {'load CPU-s':>10}",
    ]
    for name, r in (("plain", plain), ("zstd", zstd)):
        lines.append(
            f"  {name:6} {r['stored_bytes'] / 2**20:10.2f} {r['save_s']:8.3f} {r['save_cpu_s']:10.2f} "
            f"{r['load_s']:8.3f} {r['load_cpu_s']:10.2f}"
        )
    lines.append(
        f"  zstd/plain: stored {zstd['stored_bytes'] / plain['stored_bytes']:.3f}x, "
        f"save CPU {zstd['save_cpu_s'] / max(plain['save_cpu_s'], 1e-9):.2f}x, "
        f"load CPU {zstd['load_cpu_s'] / max(plain['load_cpu_s'], 1e-9):.2f}x"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="gpt", choices=("gpt", "small", "zeros"))
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("uc_checkpoint").setLevel(logging.WARNING)  # a line per save and load otherwise
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        result = measure(args.kind, args.size_mb, args.calls, Path(work))
    log.info("%s", describe(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
