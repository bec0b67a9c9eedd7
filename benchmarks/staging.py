"""Staging for ``dcp.async_save``: our writer's ``stage()`` beside DCP's ``DefaultStager``.

    python -m benchmarks.staging                       # both states, 5 repeats, table on stdout
    python -m benchmarks.staging --kinds small --repeats 3 --json staging.json

The question is how long ``async_save`` keeps the training thread, and how long until the staged
copy is complete (the point after which the loop may update parameters in place). Every figure is
set against an in-memory copy of the same state measured in the same process, interleaved repeat
by repeat so that drift on the machine hits all alike:

* ``clone``: ``{k: v.clone()}`` over the nested dict (fresh memory every time: what a stager that
  allocates per save must at least do);
* ``copy_into``: ``dst.copy_(src)`` into buffers allocated once (what a stager that keeps its
  buffers between saves must at least do; no page faults).

Methods (each saves to a local volume through ``UCVolumeWriter``; the upload is waited for before
the next measurement, and is not part of any figure):

* ``uc``: ``async_save(storage_writer=UCVolumeWriter(...))``: the writer is the stager (``stage()``);
* ``uc-async``: ``async_stager=BackgroundStager()``: the same copy in a thread of its own (what
  ``CheckpointManager(staging=Staging(background_copy=True))`` uses);
* ``uc-reused``: ``UCVolumeWriter(..., staging_buffers=StagingBuffers())`` with one
  ``StagingBuffers`` kept across saves: the writer's ``stage()`` copies into the last save's
  tensors (what ``CheckpointManager(staging=Staging(reuse_buffers=True))`` uses; compare with ``copy_into``);
* ``dcp-sync`` / ``dcp-async``: ``async_stager=DefaultStager(StagingOptions(use_pinned_memory=False,
  use_shared_memory=False, use_async_staging=False/True, use_non_blocking_copy=False))``, a new
  stager per save (so it allocates, as ``clone`` does);
* ``dcp-sync-reused`` / ``dcp-async-reused``: one stager kept across saves: DefaultStager caches
  its CPU buffers by source storage and copies into them in place (compare with ``copy_into``; it
  holds a full copy of the state between saves);
* ``dcp-shm-sync`` / ``dcp-shm-async``: ``use_shared_memory=True`` (new stager per save).

Figures (medians over repeats): ``blocked_s`` (``async_save`` call until it returns: the training
thread is blocked that long), ``staged_s`` (call until the staged copy is complete:
``staging_completion`` done for async staging, equal to ``blocked_s`` otherwise), each as the median
of its ratios to the in-memory copy measured just before it; ``peak_bytes``: peak RSS above the RSS
before the call, up to staging completion, of one cold save in a fresh process (VmHWM reset
through ``/proc/self/clear_refs``; within one process freed heap is reused and hides allocations),
against a cold ``clone`` measured the same way.

States (``--kinds``, :data:`STATES`; built by :mod:`benchmarks.state`):

* ``gpt``: float32 tensors of 16, 4 and 1 MiB (8 + 24 + 32 = 256 MiB), nested as model/optimizer
  (the ``blocks`` kind);
* ``small``: 5,000 float32 tensors of 4-64 KiB (sizes cycle 4, 16, 64 KiB; ~140 MiB) nested as
  ``{"model": {"layerN": {"tK": ...}}}``, the shape that stresses per-tensor overhead (the
  ``layers`` kind).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from uc_checkpoint import StagingBuffers, UCVolumeWriter
from uc_checkpoint.dcp.stager import BackgroundStager

from . import state
from .fmt import MIB, num
from .usage import peak_rss_above, reset_peak_rss, rss_bytes

log = logging.getLogger("benchmarks.staging")

METHODS = (
    "uc",
    "uc-async",
    "uc-reused",
    "dcp-sync",
    "dcp-async",
    "dcp-sync-reused",
    "dcp-async-reused",
    "dcp-shm-sync",
    "dcp-shm-async",
)


#: The staging benchmark's states (``--kinds``): the :mod:`benchmarks.state` kind and its full size.
STATES = {"gpt": ("blocks", 256 << 20), "small": ("layers", 5000 * state.LAYERS_MEAN_BYTES)}


def build_state(kind: str, scale: float = 1.0) -> dict[str, Any]:
    """The state dict of ``kind`` (a key of :data:`STATES`); ``scale`` shrinks it (quick runs)."""
    layout, size = STATES[kind]
    return state.build(layout, round(scale * size))


def _settle() -> int:
    """Collect garbage and hand freed heap back (so the next peak starts from a clean base); the RSS."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_bytes()


def measure_copy(sd: Any, dst: list[torch.Tensor]) -> dict[str, float]:
    """The in-memory copies: ``clone`` (fresh memory) and ``copy_into`` (into ``dst``), in seconds."""
    _settle()
    t0 = time.perf_counter()
    copy = state.cpu_copy(sd)
    clone_s = time.perf_counter() - t0
    del copy
    src = list(state.tensors_of(sd))
    _settle()
    t0 = time.perf_counter()
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)
    return {"clone_s": clone_s, "copy_into_s": time.perf_counter() - t0}


def _stager_for(method: str, kept: dict[str, Any]) -> DefaultStager | BackgroundStager | None:
    if method in ("uc", "uc-reused"):
        return None
    if method == "uc-async":
        return BackgroundStager()
    options = StagingOptions(
        use_pinned_memory=False,
        use_shared_memory="-shm-" in method,
        use_async_staging="async" in method,
        use_non_blocking_copy=False,
    )
    if method.endswith("-reused"):
        if method not in kept:
            kept[method] = DefaultStager(options)
        return kept[method]
    return DefaultStager(options)


def measure_save(sd: Any, method: str, dest: str, kept: dict[str, Any]) -> dict[str, float]:
    """One ``async_save`` with ``method``'s stager: blocked and staged seconds, peak extra bytes."""
    stager = _stager_for(method, kept)
    buffers = kept.setdefault(method, StagingBuffers()) if method == "uc-reused" else None
    writer = UCVolumeWriter(dest, staging_buffers=buffers)
    staged_at: list[float] = []
    base = _settle()
    reset_peak_rss()
    t0 = time.perf_counter()
    response = dcp.async_save(sd, storage_writer=writer, async_stager=stager)
    blocked = time.perf_counter() - t0
    if isinstance(response, AsyncSaveResponse):
        done = threading.Event()

        def _mark(_: Any) -> None:
            staged_at.append(time.perf_counter())
            done.set()

        response.staging_completion.add_done_callback(_mark)
        done.wait()
        response.staging_completion.result()  # raises a staging error
        staged = staged_at[0] - t0
        upload = response.upload_completion
    else:
        staged = blocked
        upload = response
    peak = peak_rss_above(base)
    upload.result()
    if stager is not None and not method.endswith("-reused"):
        stager.close()
    return {"blocked_s": blocked, "staged_s": staged, "peak_bytes": float(peak)}


def measure_memory(kind: str, method: str, scale: float) -> float:
    """Peak extra RSS in bytes of one cold ``method`` (``"clone"`` or a save method) on ``kind``, in
    a fresh process: within one process, freed heap is reused by the next measurement and hides
    what a method allocates."""
    code = (
        "import json, os, sys, tempfile, warnings; warnings.filterwarnings('ignore');"
        "from benchmarks import staging as s;"
        f"print(json.dumps(s._memory_here({kind!r}, {method!r}, {scale!r})))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory run of {method} on {kind} failed:\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def _memory_here(kind: str, method: str, scale: float) -> float:
    sd = build_state(kind, scale)
    if method == "clone":
        base = _settle()
        reset_peak_rss()
        copy = state.cpu_copy(sd)
        peak = peak_rss_above(base)
        del copy
        return float(peak)
    with tempfile.TemporaryDirectory(prefix="uc-staging-mem-") as tmp:
        return measure_save(sd, method, os.path.join(tmp, "ckpt"), {})["peak_bytes"]


def run(kinds: list[str], methods: list[str], repeats: int, scale: float, memory: bool = True) -> dict[str, Any]:
    """Every method on every state, ``repeats`` times; each save right after an in-memory copy of
    the same state (ratios are taken pair by pair, so drift on the machine hits both alike)."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="uc-staging-bench-") as tmp:
        for kind in kinds:
            sd = build_state(kind, scale)
            dst = [torch.empty_like(t) for t in state.tensors_of(sd)]
            kept: dict[str, Any] = {}
            samples: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
            for rep in range(repeats + 1):  # repeat 0 warms up (first save, imports, reused buffers)
                for m in methods:
                    copy = measure_copy(sd, dst)
                    row = measure_save(sd, m, os.path.join(tmp, kind, m, str(rep)), kept)
                    if rep:
                        samples[m].append({**copy, **row})
            for stager in kept.values():
                if isinstance(stager, DefaultStager):
                    stager.close()
            del sd, dst
            peaks = {m: measure_memory(kind, m, scale) for m in ["clone", *methods]} if memory else {}
            results[kind] = _summarise(kind, samples, peaks, scale)
    return results


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _summarise(
    kind: str, samples: dict[str, list[dict[str, float]]], peaks: dict[str, float], scale: float
) -> dict[str, Any]:
    tensors = list(state.tensors_of(build_state(kind, scale)))
    every = [r for rows in samples.values() for r in rows]
    clone_peak = peaks.get("clone")
    out: dict[str, Any] = {
        "tensors": len(tensors),
        "bytes": sum(t.nbytes for t in tensors),
        "clone_s": _median(every, "clone_s"),
        "copy_into_s": _median(every, "copy_into_s"),
        "clone_peak_bytes": clone_peak,
        "methods": {},
    }
    for m, rows in samples.items():
        base = "copy_into_s" if m.endswith("-reused") else "clone_s"
        peak = peaks.get(m)
        out["methods"][m] = {
            "blocked_s": _median(rows, "blocked_s"),
            "staged_s": _median(rows, "staged_s"),
            "baseline": base[:-2],
            # median of the pairwise ratios: each save against the copy measured just before it
            "blocked_x": statistics.median(r["blocked_s"] / r[base] for r in rows),
            "staged_x": statistics.median(r["staged_s"] / r[base] for r in rows),
            "peak_bytes": peak,
            "peak_x": peak / clone_peak if peak is not None and clone_peak else None,
        }
    return out


def table(results: dict[str, Any]) -> str:
    """Markdown tables of :func:`run`'s results."""
    lines = []
    for kind, r in results.items():
        lines += [
            f"### {kind}: {r['tensors']} tensors, {r['bytes'] / 2**20:.0f} MiB; "
            f"clone {r['clone_s'] * 1e3:.1f} ms, copy into preallocated {r['copy_into_s'] * 1e3:.1f} ms, "
            f"clone peak {num(r['clone_peak_bytes'], MIB, 0)} MiB (medians)",
            "",
            "| method | blocked ms | staged ms | vs | blocked x | staged x | peak extra MiB | peak x clone |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m, row in r["methods"].items():
            lines.append(
                f"| {m} | {row['blocked_s'] * 1e3:.1f} | {row['staged_s'] * 1e3:.1f} | {row['baseline']} "
                f"| {row['blocked_x']:.2f} | {row['staged_x']:.2f} | {num(row['peak_bytes'], MIB, 0)} "
                f"| {num(row['peak_x'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["gpt", "small"], choices=["gpt", "small"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the states (quick runs)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-method memory processes")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--report", type=Path, help="write the tables as a markdown page here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("uc_checkpoint").setLevel(logging.WARNING)  # one line per save otherwise
    warnings.filterwarnings("ignore")  # DCP warns on every no-process-group save
    results = run(args.kinds, args.methods, args.repeats, args.scale, memory=not args.no_memory)
    log.info("%s", table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.report:
        args.report.write_text(
            "# Staging for async_save: blocked time, time to a complete copy, memory\n\n"
            "Generated by `python -m benchmarks.staging` (run by `./scripts/bench.sh`); do not edit by hand. "
            "Methods and figures: the docstring of `benchmarks/staging.py`. "
            f"{args.repeats} repeats, run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
            "`x` columns are ratios to the in-memory copy named in `vs`, measured just before each save.\n\n"
            + table(results)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
