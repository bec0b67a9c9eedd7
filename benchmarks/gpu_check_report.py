"""The environment and the results of :mod:`benchmarks.gpu_check`: what the check ran on, its state,
each method's figures summarised, and the markdown table it prints."""

from __future__ import annotations

import os
import platform
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch

import uc_checkpoint

from . import state
from .fmt import GIB


def environment(device: torch.device, workdir: Path) -> dict[str, Any]:
    """Versions, the GPU and the disk the check ran on."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "uc_checkpoint": uc_checkpoint.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": None,
        "workdir": str(workdir),
        "workdir_free_bytes": shutil.disk_usage(workdir).free,
        "workdir_fs": _filesystem_of(workdir),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, gpu_capability=f"{props.major}.{props.minor}")
        try:  # the NVIDIA kernel module's version line, where the driver exposes it
            env["nvidia_driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
        except (OSError, IndexError):
            env["nvidia_driver"] = None
    return env


def _filesystem_of(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on (``/proc/mounts``; None where unreadable)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    real = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    return kind


def state_summary(sd: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Bytes (all, and by dtype), tensors (all, and on ``device``) and parameters of ``sd``."""
    tensors = list(state.tensors_of(sd))
    by_dtype: dict[str, int] = {}
    for t in tensors:
        by_dtype[str(t.dtype)] = by_dtype.get(str(t.dtype), 0) + t.nbytes
    return {
        "bytes": sum(t.nbytes for t in tensors),
        "tensors": len(tensors),
        "on_device": sum(1 for t in tensors if t.device.type == device.type),
        "parameters": sum(t.numel() for t in sd["model"].values()),
        "bytes_by_dtype": by_dtype,
    }


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    """One method's figures: its ``first`` save apart, medians of its other ``samples`` (None
    without any), each sample under ``repeats``, and its load check (None where not run)."""
    out = {k: v for k, v in row.items() if k != "samples"}
    samples = row["samples"]
    out["repeats_done"] = len(samples)
    for key in ("blocked_s", "staged_s", "published_s"):
        out[key] = statistics.median(s[key] for s in samples) if samples else None
    out["repeats"] = samples
    for key in ("load_s", "bit_exact", "mismatch", "page_cache_dropped"):
        out.setdefault(key, None)
    return out


def passed(results: dict[str, Any]) -> bool:
    """Every method saved without error and loaded back bit-exact."""
    return all(r["error"] is None and r["bit_exact"] is True for r in results["methods"].values())


def table(results: dict[str, Any]) -> str:
    """The results as one markdown table, under a line naming the GPU, torch and the state."""
    env, st = results["env"], results["state"]
    where = env["gpu"] or env["device"]
    lines = [
        f"gpu_check: {where}, torch {env['torch']} (CUDA {env['cuda']}), state {st['bytes'] / GIB:.3f} GiB "
        f"({st['tensors']} tensors, {st['on_device']} on {env['device']}), "
        f"repeats {results['settings']['repeats']}, {results['elapsed_s']:.0f} s",
        "",
        "| method | stager | first: blocked s | first: to .metadata s | blocked s | staged s | to .metadata s "
        "| load s | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for m, r in results["methods"].items():
        first = r["first"] or {}
        exact = "error" if r["error"] else {True: "yes", False: f"NO ({r['mismatch']})", None: "-"}[r["bit_exact"]]
        lines.append(
            f"| {m} | {r['stager']} | {sec(first.get('blocked_s'))} | {sec(first.get('published_s'))} "
            f"| {sec(r['blocked_s'])} | {sec(r['staged_s'])} | {sec(r['published_s'])} | {sec(r['load_s'])} "
            f"| {exact} |"
        )
    if results.get("warm_up_error"):
        lines += ["", f"warm-up save failed: {results['warm_up_error']}"]
    if results["skipped"]:
        lines += ["", "skipped: " + "; ".join(results["skipped"])]
    for m, r in results["methods"].items():
        if r["error"]:
            lines += ["", f"{m} failed: {r['error']}"]
    return "\n".join(lines)
