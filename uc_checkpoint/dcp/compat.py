"""Every private name of torch (and of Python) that uc_checkpoint relies on, in one place.

DCP's storage API is public (``StorageWriter``, ``StorageReader``, ``Metadata``, the planners), but
writing DCP's file format exactly as ``FileSystemWriter`` does, so that stock readers load our
checkpoints, needs a few of ``torch.distributed.checkpoint.filesystem``'s private helpers. Private
names change between releases without notice (s3torchconnector and others break the same way), so
they are imported only here; each is listed with what it is for and the torch versions it was
checked against. A new torch that moves one breaks this module's import, one place to mend, rather
than five modules. The pattern is s3transfer's ``compat.py``.

Checked against torch 2.13.0 (the pinned CPU wheel); the package allows ``torch>=2.6,<2.15``, and
these names are the ones DCP's own ``FileSystemWriter``/``FileSystemReader`` have used since 2.4.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

# DCP's file format: the per-item storage record in .metadata, the per-rank file prefix of a save
# plan, how FileSystemWriter splits a rank's items into files, and the two
# loaders that move tensors to the CPU ahead of serialisation.
from torch.distributed._shard._utils import narrow_tensor_by_index  # noqa: F401 - re-exported
from torch.distributed.checkpoint.filesystem import (  # noqa: F401 - re-exported
    _OverlappingCpuLoader,
    _SerialCpuLoader,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)

# DCP's stream extensions (experimental; torch 2.7+): compression and user transforms of each
# item's bytes (``FileSystemWriter(_extensions=...)``, ``FileSystemReader(_extension_registry=...)``).
try:
    from torch.distributed.checkpoint._extension import (  # noqa: F401 - re-exported
        ExtensionRegistry,
        StreamTransformExtension,
    )

    HAS_STREAM_EXTENSIONS = True
except ImportError:  # pragma: no cover - older torch: the writer and reader refuse extensions
    HAS_STREAM_EXTENSIONS = False
    ExtensionRegistry = StreamTransformExtension = None  # type: ignore[assignment,misc]

try:  # the version string DCP stamps into .metadata (2.5+)
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    CURRENT_DCP_VERSION = "1.0.0"  # type: ignore[misc]


def default_store() -> Any:
    """The default process group's c10d key-value store (``distributed_c10d._get_default_store``,
    checked on torch 2.13). Its ``set``/``get``/``add`` are requests to the store, not collectives
    on a process group, so the training thread may use them while a background save's collectives
    run (:meth:`uc_checkpoint.ops.ranks.RankGroup.decided`).

    Raises:
        ValueError (torch's): the default process group is not initialised.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def default_group_timeout() -> timedelta:
    """The timeout of the default process group's collectives: what
    ``init_process_group(timeout=...)`` set (torch's default when none was given). Read from the
    group's backend options (``ProcessGroup._get_backend(device).options._timeout``, checked on
    torch 2.13 for gloo and NCCL), the CPU backend first; where this torch has no such field, the
    default store's timeout (``Store.timeout``, which ``init_process_group`` sets to the same
    value).

    Raises:
        ValueError (torch's): the default process group is not initialised.
    """
    from torch.distributed import distributed_c10d

    pg = distributed_c10d._get_default_group()
    devices = sorted(getattr(pg, "_device_types", []), key=lambda d: d.type != "cpu")
    for device in devices:
        try:
            timeout = pg._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):  # no backend for that device, or a torch without the field
            continue
        if isinstance(timeout, timedelta):
            return timeout
    timeout = default_store().timeout
    assert isinstance(timeout, timedelta)
    return timeout


def set_default_group_timeout(timeout: timedelta) -> None:
    """Give the default process group's collectives ``timeout`` from now on
    (``distributed_c10d._set_pg_timeout``, torch 2.3+, checked on 2.13: gloo and NCCL backends).
    Used in DCP's PROCESS-mode checkpoint process, whose group DCP creates without a timeout."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, None)


def cpu_loader(resolve: Callable[[Any], Any], thread_count: int, copy_ahead_bytes: int) -> Any:
    """The loader DCP's ``_write_files_from_queue`` would choose: tensors of a synchronous save on an
    accelerator (CUDA or a PrivateUse1 device) are copied to the CPU ahead of serialisation when one
    thread serialises; otherwise one at a time. Mirrors torch 2.13's condition, copied because the
    choice is made inside a private function."""
    backend = torch._C._get_privateuse1_backend_name()
    custom = getattr(torch, backend, None)
    accelerator = torch.cuda.is_available() or bool(custom is not None and custom.is_available())
    if thread_count == 1 and accelerator and copy_ahead_bytes > 0:
        return _OverlappingCpuLoader(resolve, inflight_threshhold=copy_ahead_bytes)
    return _SerialCpuLoader(resolve)


def dtensor_local(t: Any) -> torch.Tensor:
    """A DTensor's local shard itself (``to_local()`` would go through autograd)."""
    return t._local_tensor


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (``Tensor._version``; torch 1.x to 2.14, checked on 2.13), which each
    in-place change of its storage through autograd-visible ops raises (an optimizer step
    included). :class:`~uc_checkpoint.dcp.stager.BackgroundStager` compares it before and after its
    copy to tell that a tensor changed meanwhile. Inference tensors have none (RuntimeError)."""
    return t._version


def dtensor_like(local: torch.Tensor, template: Any) -> Any:
    """A DTensor with ``template``'s mesh, placements and global shape around ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, template._spec, requires_grad=False)


@functools.cache  # a property of the installed torch, probed once per process
def _zip_writer_without_crc() -> Callable[[Any], Any] | None:
    """A factory of torch's zip writer (``torch._C.PyTorchFileWriter(buffer, compute_crc32,
    storage_alignment)``, torch 2.6+) that skips the CRC-32 of each record, or None when this
    torch's writer takes other arguments."""
    import torch.serialization as ser

    writer = getattr(torch._C, "PyTorchFileWriter", None)
    alignment = getattr(ser, "_get_storage_alignment", None)
    if writer is None or alignment is None or not callable(getattr(ser, "_save", None)):
        return None
    try:  # probe the signature once: a torch that changed it must not break every save
        probe = io.BytesIO()
        writer(probe, False, alignment()).write_end_of_file()
    except (TypeError, RuntimeError):
        return None
    return lambda buffer: writer(buffer, False, alignment())


def save_without_zip_crc(obj: Any, stream: Any) -> None:
    """``torch.save(obj, stream)`` without the zip format's CRC-32 of each record, as torch does with
    ``torch.utils.serialization.config.save.compute_crc32 = False`` (2.6+) but without changing that
    process-wide setting under other threads.

    Why: miniz's CRC-32 over every tensor byte was ~15% of a save's client CPU, and nothing uses it:
    ``torch.load`` does not check it (torch builds miniz with its CRC checks off) and our manifest
    keeps a CRC-32 of every block of every data file, checked on load. Falls back to ``torch.save``
    on a torch whose private writer has another signature.
    """
    make = _zip_writer_without_crc()
    if make is None:
        torch.save(obj, stream)
        return
    import pickle

    import torch.serialization as ser

    zip_file = make(stream)
    try:
        ser._save(obj, zip_file, pickle, ser.DEFAULT_PROTOCOL, False)
    except BaseException:
        # As torch.save's context manager: the writer must be finalised here, or its destructor
        # finalises it, and a failing write there (a full disk) aborts the process.
        with contextlib.suppress(Exception):
            zip_file.write_end_of_file()
        raise
    zip_file.write_end_of_file()


def copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair in one call into torch (``torch._foreach_copy_``, 2.1+): the
    GIL is released once for all of them, not per tensor; a loop of ``copy_`` where it is missing."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dsts, srcs)
        return
    for dst, src in zip(dsts, srcs, strict=True):  # pragma: no cover - torch without it
        dst.copy_(src)


__all__ = [
    "CURRENT_DCP_VERSION",
    "ExtensionRegistry",
    "HAS_STREAM_EXTENSIONS",
    "StreamTransformExtension",
    "_OverlappingCpuLoader",
    "_SerialCpuLoader",
    "_StorageInfo",
    "_StoragePrefix",
    "_split_by_size_and_type",
    "copy_tensors",
    "cpu_loader",
    "default_group_timeout",
    "default_store",
    "dtensor_like",
    "dtensor_local",
    "narrow_tensor_by_index",
    "save_without_zip_crc",
    "set_default_group_timeout",
    "tensor_version",
]
