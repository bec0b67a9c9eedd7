"""The CPU snapshot ``dcp.async_save`` takes while training waits: one copy of every tensor.

DCP's own blocking stager (``FileSystemWriter.stage``, torch 2.6-2.14) copies a DTensor's data
twice: ``copy.deepcopy`` (or ``.to("cpu")`` for an accelerator tensor) clones the shard, then the
clone is replaced by an empty tensor and the shard is copied again; for a sharded model that is
most of the time ``async_save`` blocks training. :func:`cpu_snapshot` allocates each destination
once and copies once, into pinned memory for accelerator tensors (then one synchronisation per
device), so the snapshot costs what a plain copy costs. Big CPU tensors are copied on threads of our
own (:mod:`uc_checkpoint.dcp.parallel_copy`).

:class:`BackgroundStager` takes the same snapshot in a thread of its own, so that ``async_save``
returns at once and training is blocked only by the walk that records every tensor's version
(``dcp.async_save(..., async_stager=BackgroundStager())``; the caller waits for the response's
``staging_completion`` before changing any tensor in place).

Figures, against DCP's stagers (the ``uc`` and ``uc-async`` rows against the ``dcp-*`` ones):
docs/benchmarks-staging.md; those behind this module's choices are in its "Figures behind the
snapshot walk".
"""

from __future__ import annotations

import copy
import io
import logging
import threading
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from uc_checkpoint.dcp.buffers import BufferLease
from uc_checkpoint.dcp.compat import dtensor_like, dtensor_local, tensor_version
from uc_checkpoint.dcp.parallel_copy import CopyThreads
from uc_checkpoint.errors import StateChangedWhileStagingError

logger = logging.getLogger(__name__)

try:  # torch >= 2.5 (the package requires >= 2.6)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


class UnsupportedSnapshot(Exception):
    """A value :func:`cpu_snapshot` leaves to DCP's own stager (a ``ShardedTensor``, or a tensor
    subclass other than DTensor)."""


@torch.no_grad()
def cpu_snapshot(state_dict: Any, buffers: BufferLease | None = None) -> Any:
    """Copy a (nested) state dict to CPU memory, every tensor exactly once.

    Dicts, lists and tuples are rebuilt with the same keys and order; a tensor that appears twice
    (tied weights) is copied once and appears twice in the result. DTensors keep their device mesh,
    placements and global shape (only the local shard is copied). ``int``, ``float``, ``str``,
    ``bytes`` and ``None`` are shared (immutable); ``io.BytesIO`` is copied; anything else is
    ``copy.deepcopy``'d, as DCP's stager does.

    Args:
        state_dict: what ``dcp.async_save`` is about to save (after ``Stateful.state_dict()``).
        buffers: tensors kept from an earlier snapshot of the same state
            (:class:`~uc_checkpoint.dcp.buffers.StagingBuffers`): each copy goes into the next one
            that fits (shape, dtype, pinning) instead of new memory; the tensors used, kept or
            new, are recorded in the lease.

    Returns:
        The snapshot: the same structure, with contiguous CPU tensors that training can no longer
        change. Tensors copied from an accelerator are in pinned memory.

    Raises:
        UnsupportedSnapshot: the state dict holds a ``ShardedTensor``, another tensor subclass or a
            sparse tensor; the caller falls back to DCP's stager.
    """
    memo: dict[int, Any] = {}
    devices: set[torch.device] = set()
    copies = CopyThreads(buffers)
    try:
        out = _snapshot(state_dict, memo, devices, copies)
        copies.run()
    finally:
        # Non-blocking copies into pinned memory must land before saving, and before a failed
        # snapshot's kept buffers serve another one (whose copies may run on another stream).
        for device in devices:
            getattr(torch, device.type).synchronize(device)
    return out


_Tensor = torch.Tensor
_STRIDED = torch.strided


def _snapshot(obj: Any, memo: dict[int, Any], devices: set[torch.device], copies: CopyThreads) -> Any:
    # The common case first and with the fewest checks: a model of many small tensors spends more
    # of its staging time in Python per tensor than in copying (docs/benchmarks-staging.md, "Figures
    # behind the snapshot walk").
    if type(obj) is _Tensor and obj.is_cpu and obj.layout is _STRIDED:
        key = id(obj)
        out = memo.get(key)
        if out is None:
            out = memo[key] = copies.clone(obj)
        return out
    if type(obj) is dict:
        return _snapshot_dict(obj, memo, devices, copies)
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = _snapshot_tensor(obj, devices, copies)
        return memo[key]
    if isinstance(obj, (int, float, str, bytes)) or obj is None:
        return obj
    if isinstance(obj, dict):  # a subclass (OrderedDict) too, rebuilt as a plain dict
        return _snapshot_dict(obj, memo, devices, copies)
    if isinstance(obj, list):
        return [_snapshot(v, memo, devices, copies) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v, memo, devices, copies) for v in obj)
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return copy.deepcopy(obj)


def _snapshot_dict(
    obj: dict[Any, Any], memo: dict[int, Any], devices: set[torch.device], copies: CopyThreads
) -> dict[Any, Any]:
    # _snapshot's tensor fast path repeated inline, saving a call per small tensor
    # (docs/benchmarks-staging.md, "Figures behind the snapshot walk").
    out = {}
    for k, v in obj.items():
        if type(v) is _Tensor and v.is_cpu and v.layout is _STRIDED:
            key = id(v)
            copied = memo.get(key)
            if copied is None:
                copied = memo[key] = copies.clone(v)
            out[k] = copied
        else:
            out[k] = _snapshot(v, memo, devices, copies)
    return out


def _snapshot_tensor(t: torch.Tensor, devices: set[torch.device], copies: CopyThreads) -> torch.Tensor:
    if DTensor is not None and type(t) is DTensor:
        # Same mesh, placements and global shape/stride: DCP plans the save from the spec.
        return dtensor_like(_copy_plain(dtensor_local(t), devices, copies), t)
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedSnapshot(f"{type(t).__name__} is staged by DCP's own stager")
    if t.layout != torch.strided:
        raise UnsupportedSnapshot(f"a {t.layout} tensor is staged by DCP's own stager")
    return _copy_plain(t, devices, copies)


def _copy_plain(t: torch.Tensor, devices: set[torch.device], copies: CopyThreads) -> torch.Tensor:
    if t.is_cpu:
        return copies.clone(t.detach())
    pin = t.device.type == "cuda" and torch.cuda.is_available()
    lease = copies.buffers
    out = lease.take(t, pin) if lease is not None else None
    if out is None:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        if lease is not None:
            lease.keep(out, pin)
    out.copy_(t.detach(), non_blocking=pin)
    if pin:
        devices.add(t.device)
    return out


def _versions(obj: Any, out: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    """Every tensor of a (nested) state dict with its version counter (which each in-place op, an
    optimizer step included, increments). Inference tensors have none and are left out."""
    if type(obj) is torch.Tensor:  # the common case first: this walk is what training waits for
        if not obj.is_inference():
            out.append((obj, tensor_version(obj)))
    elif isinstance(obj, torch.Tensor):
        t = dtensor_local(obj) if DTensor is not None and type(obj) is DTensor else obj
        if not t.is_inference():
            out.append((t, tensor_version(t)))
    elif isinstance(obj, dict):
        for v in obj.values():
            _versions(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _versions(v, out)
    return out


class BackgroundStager(AsyncStager):
    """An ``AsyncStager`` for ``dcp.async_save`` that takes :func:`cpu_snapshot` in a thread of its
    own: ``async_save`` returns after one walk over the state dict (recording each tensor's version
    counter), and returns an ``AsyncSaveResponse`` whose ``staging_completion`` completes when the
    copy is done::

        response = dcp.async_save(state, storage_writer=UCVolumeWriter(url), async_stager=BackgroundStager())
        ...                                     # forward / backward: nothing may change the state
        response.staging_completion.result()    # before optimizer.step(), always
        optimizer.step()

    The rule: no tensor of the state may change before ``staging_completion`` is done. A tensor
    changed in place meanwhile (its version counter moved: in-place ops, ``optimizer.step()``;
    writes through ``.data`` or into another view's storage are not counted) fails the staging with
    :class:`~uc_checkpoint.errors.StateChangedWhileStagingError`, and with it the save: nothing is
    published, instead of a checkpoint that mixes two steps. Stateless between saves (nothing is
    cached, nothing to close); one thread per staging. A state dict :func:`cpu_snapshot` leaves to
    DCP (``ShardedTensor``, other tensor subclasses) is copied by DCP's ``DefaultStager`` in the same
    thread.
    """

    _synchronize_after_execute = False  # the caller waits on staging_completion instead

    def __init__(self) -> None:
        """No options: the copy is :func:`cpu_snapshot`'s (pinned memory for accelerator tensors)."""

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        """Start copying ``state_dict`` to CPU memory; a future of the copy.

        Raises (through the future): StateChangedWhileStagingError: a tensor changed in place before
        the copy was complete; any error of the copy itself (e.g. an object ``copy.deepcopy``
        refuses)."""
        versions = _versions(state_dict, [])  # the state as of this call: the one to be saved
        fut: Future[dict[str, Any]] = Future()
        fut.set_running_or_notify_cancel()
        # Not a daemon: an interpreter exit right after async_save lets the copy finish (the save
        # waits for it, and Python's exit joins DCP's save thread: uc_checkpoint.dcp.handover).
        threading.Thread(
            target=_stage_into, args=(state_dict, versions, fut), name="uc-checkpoint-staging", daemon=False
        ).start()
        return fut

    def synchronize_staging(self) -> None:
        """Nothing to do: wait on ``staging_completion`` (DCP deprecates this method)."""

    def close(self) -> None:
        """Nothing to release: each staging has its own thread, which ends with the copy."""


def _stage_into(state_dict: dict[str, Any], versions: list[tuple[torch.Tensor, int]], fut: Future[Any]) -> None:
    try:
        try:
            staged = cpu_snapshot(state_dict)
        except UnsupportedSnapshot as exc:
            logger.debug("staging with DCP's stager: %s", exc)
            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                staged = stager.stage(state_dict)
            finally:
                stager.close()
        changed = sum(1 for t, v in versions if tensor_version(t) != v)
        if changed:
            raise StateChangedWhileStagingError(
                f"{changed} of {len(versions)} tensors of the state were changed in place while they were "
                "being staged for an async save; the save is abandoned (the copy may mix two steps). "
                "Wait for the staging (CheckpointManager.wait_until_staged() or the staging_completion "
                "future of dcp.async_save) before the next optimizer step."
            )
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the waiting save
        fut.set_exception(exc)
    else:
        fut.set_result(staged)
