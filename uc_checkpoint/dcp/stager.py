"""The CPU snapshot ``dcp.async_save`` takes while training waits: one copy of every tensor.

DCP's own blocking stager (``FileSystemWriter.stage``, torch 2.6-2.14) copies a DTensor's data
twice: ``copy.deepcopy`` (or ``.to("cpu")`` for an accelerator tensor) clones the shard, then the
clone is replaced by an empty tensor and the shard is copied again. For a sharded model that is
most of the time ``async_save`` blocks training (2 ranks, 242 MiB GPT + AdamW: 0.24 s blocked vs
0.064 s for one copy; docs/benchmarks.md). :func:`cpu_snapshot` allocates each destination once
and copies once, into pinned memory for accelerator tensors (then one synchronisation per device),
so the snapshot costs what a plain copy costs.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch

from uc_checkpoint.dcp.compat import dtensor_like, dtensor_local

try:  # torch >= 2.5 (the package requires >= 2.6)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


class UnsupportedSnapshot(Exception):
    """A value :func:`cpu_snapshot` leaves to DCP's own stager (a ``ShardedTensor``, or a tensor
    subclass other than DTensor)."""


@torch.no_grad()
def cpu_snapshot(state_dict: Any) -> Any:
    """Copy a (nested) state dict to CPU memory, every tensor exactly once.

    Dicts, lists and tuples are rebuilt with the same keys and order; a tensor that appears twice
    (tied weights) is copied once and appears twice in the result. DTensors keep their device mesh,
    placements and global shape (only the local shard is copied). ``int``, ``float``, ``str``,
    ``bytes`` and ``None`` are shared (immutable); ``io.BytesIO`` is copied; anything else is
    ``copy.deepcopy``'d, as DCP's stager does.

    Args:
        state_dict: what ``dcp.async_save`` is about to save (after ``Stateful.state_dict()``).

    Returns:
        The snapshot: the same structure, with contiguous CPU tensors that training can no longer
        change. Tensors copied from an accelerator are in pinned memory.

    Raises:
        UnsupportedSnapshot: the state dict holds a ``ShardedTensor``, another tensor subclass or a
            sparse tensor; the caller falls back to DCP's stager.
    """
    memo: dict[int, Any] = {}
    devices: set[torch.device] = set()
    out = _snapshot(state_dict, memo, devices)
    for device in devices:  # non-blocking copies into pinned memory must land before saving
        getattr(torch, device.type).synchronize(device)
    return out


def _snapshot(obj: Any, memo: dict[int, Any], devices: set[torch.device]) -> Any:
    # The common case first and with the fewest checks: a model of many small tensors spends more
    # of its staging time in Python per tensor than in copying (5,000 tensors of 4-64 KiB: 1.5x a
    # clone with the general path below, 1.1x with this one; benchmarks/staging.py).
    if type(obj) is torch.Tensor and obj.is_cpu and obj.layout is torch.strided:
        key = id(obj)
        out = memo.get(key)
        if out is None:
            # clone (under no_grad: no autograd history) allocates and copies in one dispatch;
            # empty + copy_ + detach is three, ~1.5x the time for a 16 KiB tensor.
            out = memo[key] = obj.clone(memory_format=torch.contiguous_format)
        return out
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = _snapshot_tensor(obj, devices)
        return memo[key]
    if isinstance(obj, (int, float, str, bytes)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {k: _snapshot(v, memo, devices) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v, memo, devices) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v, memo, devices) for v in obj)
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return copy.deepcopy(obj)


def _snapshot_tensor(t: torch.Tensor, devices: set[torch.device]) -> torch.Tensor:
    if DTensor is not None and type(t) is DTensor:
        # Same mesh, placements and global shape/stride: DCP plans the save from the spec.
        return dtensor_like(_copy_plain(dtensor_local(t), devices), t)
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedSnapshot(f"{type(t).__name__} is staged by DCP's own stager")
    if t.layout != torch.strided:
        raise UnsupportedSnapshot(f"a {t.layout} tensor is staged by DCP's own stager")
    return _copy_plain(t, devices)


def _copy_plain(t: torch.Tensor, devices: set[torch.device]) -> torch.Tensor:
    pin = t.device.type == "cuda" and torch.cuda.is_available()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t.detach(), non_blocking=pin)
    if pin:
        devices.add(t.device)
    return out
