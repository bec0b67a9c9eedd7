"""The CPU snapshot ``dcp.async_save`` takes while training waits: one copy of every tensor.

DCP's own blocking stager (``FileSystemWriter.stage``, torch 2.6-2.14) copies a DTensor's data
twice: ``copy.deepcopy`` (or ``.to("cpu")`` for an accelerator tensor) clones the shard, then the
clone is replaced by an empty tensor and the shard is copied again. For a sharded model that is
most of the time ``async_save`` blocks training (2 ranks, 242 MiB GPT + AdamW: 0.24 s blocked vs
0.064 s for one copy; docs/benchmarks.md). :func:`cpu_snapshot` allocates each destination once
and copies once, into pinned memory for accelerator tensors (then one synchronisation per device),
so the snapshot costs what a plain copy costs. Tensors big enough for torch to copy on several
OpenMP threads are copied by threads of our own instead (:class:`_CopyThreads`): with OpenMP, torch's
pool threads keep spinning on their cores for milliseconds after the copy, which delays the thread
``dcp.async_save`` starts next, and with it the moment training gets back (measured: 0-2.5 ms on a
32 MiB snapshot, every other save).

:class:`BackgroundStager` takes the same snapshot in a thread of its own, so that ``async_save``
returns at once and training is blocked only by the walk that records every tensor's version
(``dcp.async_save(..., async_stager=BackgroundStager())``; the caller waits for the response's
``staging_completion`` before changing any tensor in place). Measured beside DCP's ``DefaultStager``
in ``benchmarks/staging.py``: both block for a few milliseconds; ours completes its copy in about
a clone's time also for thousands of small tensors, where DefaultStager's deepcopy takes 2-3x.
"""

from __future__ import annotations

import _thread
import copy
import ctypes
import functools
import io
import itertools
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from uc_checkpoint.dcp.buffers import BufferLease
from uc_checkpoint.dcp.compat import copy_tensors, dtensor_like, dtensor_local
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
    copies = _CopyThreads(buffers)
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
_CONTIGUOUS = torch.contiguous_format
#: Tensors of at least this many elements are left to :class:`_CopyThreads`; torch copies smaller
#: ones on the calling thread alone anyway (ATen's ``GRAIN_SIZE``), so they are cloned in the walk.
_THREADED_MIN_NUMEL = 32768
#: Bytes each copy thread gets at least: starting a thread costs ~0.1 ms, copying 4 MiB into new
#: memory ~1 ms here.
_BYTES_PER_COPY_THREAD = 4 << 20


def _snapshot(obj: Any, memo: dict[int, Any], devices: set[torch.device], copies: _CopyThreads) -> Any:
    # The common case first and with the fewest checks: a model of many small tensors spends more
    # of its staging time in Python per tensor than in copying (5,000 tensors of 4-64 KiB: 1.5x a
    # clone with the general path below, 1.1x with this one; benchmarks/staging.py).
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
    obj: dict[Any, Any], memo: dict[int, Any], devices: set[torch.device], copies: _CopyThreads
) -> dict[Any, Any]:
    # _snapshot's tensor fast path repeated inline: a call per value was a third of the Python
    # time per small tensor (benchmarks/staging.py's 5,000 tensors of 4-64 KiB, memory already
    # mapped: 1.11x a clone of each with a call per value, 1.07x inline).
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


def _snapshot_tensor(t: torch.Tensor, devices: set[torch.device], copies: _CopyThreads) -> torch.Tensor:
    if DTensor is not None and type(t) is DTensor:
        # Same mesh, placements and global shape/stride: DCP plans the save from the spec.
        return dtensor_like(_copy_plain(dtensor_local(t), devices, copies), t)
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedSnapshot(f"{type(t).__name__} is staged by DCP's own stager")
    if t.layout != torch.strided:
        raise UnsupportedSnapshot(f"a {t.layout} tensor is staged by DCP's own stager")
    return _copy_plain(t, devices, copies)


def _copy_plain(t: torch.Tensor, devices: set[torch.device], copies: _CopyThreads) -> torch.Tensor:
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


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's CPU kernels run on, for setting one thread's OpenMP thread count
    (``omp_set_num_threads`` sets it for the calling thread only, unlike ``torch.set_num_threads``,
    which also changes every other thread's and clears oneDNN's primitive cache). None when torch
    does not use OpenMP or the runtime cannot be found (then :class:`_CopyThreads` leaves every copy
    to torch). Cached: which runtime the process loaded does not change."""
    if not torch.backends.openmp.is_available():
        return None
    torch.get_num_threads()  # ATen's per-thread OpenMP set-up first, or it undoes the probe below
    for name in _loaded_openmp_libraries():
        try:
            # RTLD_NOLOAD: only a runtime this process has loaded already (no second copy).
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
            lib.omp_get_max_threads.restype = ctypes.c_int
            before = lib.omp_get_max_threads()
            lib.omp_set_num_threads(1)
            # torch reads this thread's OpenMP setting: is this the runtime it runs on?
            found = torch.get_num_threads() == 1
            lib.omp_set_num_threads(before)
        except (OSError, AttributeError):
            continue
        if found:
            return lib
    return None


#: The OpenMP runtimes' usual names (GNU, LLVM, Intel), tried before the process's mappings are read.
_OPENMP_NAMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so")


def _loaded_openmp_libraries() -> Iterator[str]:
    """Names to open the loaded OpenMP runtime by: the usual sonames, then (read only if none of
    those is the one) the paths of every mapped ``libgomp``/``libomp``/``libiomp``, as a wheel may
    bundle one under another name."""
    yield from _OPENMP_NAMES
    try:
        with open(f"/proc/{os.getpid()}/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "omp" in line}
    except OSError:  # not Linux: the sonames only
        return
    yield from sorted(p for p in paths if os.path.basename(p).startswith(("libgomp", "libomp", "libiomp")))


class _CopyThreads:
    """The copies of one snapshot that torch would split over OpenMP threads, made on threads of
    our own instead, each with OpenMP at one thread: the calling thread and up to
    ``torch.get_num_threads() - 1`` helpers (one per :data:`_BYTES_PER_COPY_THREAD` queued), which
    end with the copy. The threads take pieces of at most :data:`_COPY_PIECE_BYTES` from one list
    until none is left (a thread that started later or faults more slowly takes fewer), so the copy
    takes about what torch's own takes, but no OpenMP thread is left spinning afterwards.

    :meth:`clone` allocates a tensor's copy and, for a big contiguous tensor, queues the copy;
    :meth:`run` makes the queued copies. Without an OpenMP runtime to set (:func:`_openmp`), or with
    one thread, :meth:`clone` copies at once, as ``Tensor.clone`` does."""

    def __init__(self, buffers: BufferLease | None = None) -> None:
        self.buffers = buffers
        self._queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._bytes = 0
        self._threads = torch.get_num_threads()
        self._omp = _openmp() if self._threads > 1 else None

    def clone(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU copy of CPU tensor ``t`` (its bytes copied by :meth:`run` when queued),
        into a kept tensor when the lease offers one that fits."""
        if self.buffers is not None:
            return self._into_kept(t, self.buffers)
        if self._inline(t):
            # clone (under no_grad: no autograd history) allocates and copies in one dispatch;
            # empty + copy_ + detach is three, ~1.5x the time for a 16 KiB tensor.
            return t.clone(memory_format=_CONTIGUOUS)
        return self._queue(t, torch.empty_like(t, memory_format=_CONTIGUOUS))

    def _into_kept(self, t: torch.Tensor, lease: BufferLease) -> torch.Tensor:
        if t.is_quantized or t.is_conj() or t.is_neg():
            return t.clone(memory_format=_CONTIGUOUS)  # rare; copied as they are, never kept
        inline = self._inline(t)
        out = lease.take(t, False)
        if out is None:
            out = t.clone(memory_format=_CONTIGUOUS) if inline else torch.empty_like(t, memory_format=_CONTIGUOUS)
            lease.keep(out, False)
            return out if inline else self._queue(t, out)
        if inline:
            out.copy_(t)
            return out
        return self._queue(t, out, mapped=True)

    def _queue(self, t: torch.Tensor, out: torch.Tensor, mapped: bool = False) -> torch.Tensor:
        self._queued.append((t, out))
        if not mapped:
            # Only copies into new memory count towards helpers: they are bound by page faults,
            # which threads share out; a copy into mapped memory is bound by memory bandwidth,
            # and a helper there cost more than it gave (32 tensors, 64 MiB: 5.0 ms with one,
            # 4.2 on the calling thread alone).
            self._bytes += t.numel() * t.element_size()
        return out

    def _inline(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is copied at once on this thread (small, strided, or no OpenMP to set)."""
        return (
            self._omp is None
            or t.numel() < _THREADED_MIN_NUMEL
            or not t.is_contiguous()
            or t.is_quantized
            or t.is_conj()
            or t.is_neg()
        )

    def run(self) -> None:
        """Make the queued copies; raises what a copy raised."""
        if not self._queued:
            return
        omp = self._omp
        assert omp is not None
        pieces, self._queued = _pieces(self._queued, _COPY_PIECE_BYTES), []
        helpers = max(0, min(self._threads, self._bytes // _BYTES_PER_COPY_THREAD, len(pieces)) - 1)
        work = _CopyWork(pieces, omp)
        done = [threading.Lock() for _ in range(helpers)]
        for lock in done:
            lock.acquire()
            # The low-level start: threading.Thread.start waits until the new thread runs (0.2-0.8
            # ms here), time this thread spends copying instead; each helper releases its lock last.
            try:
                _thread.start_new_thread(work.copy, (lock,))
            except RuntimeError:  # no thread to be had (limits, interpreter exit): the others copy its share
                lock.release()
        work.copy(None)
        for lock in done:
            lock.acquire()
        if work.errors:
            raise work.errors[0]


#: Most bytes one copy thread takes at a time (a bigger tensor is cut into flat views; smaller ones
#: go together, copied in one call).
_COPY_PIECE_BYTES = 2 << 20

_Pairs = list[tuple[torch.Tensor, torch.Tensor]]


def _pieces(pairs: _Pairs, piece_bytes: int) -> list[_Pairs]:
    """(source, destination) pairs of contiguous tensors in pieces of at most ``piece_bytes``:
    a bigger tensor cut into flat views of that size, smaller ones together, biggest tensors first
    (the last pieces taken are small ones)."""
    out: list[_Pairs] = []
    batch: _Pairs = []
    room = 0
    for src, dst in sorted(pairs, key=lambda p: -p[0].numel() * p[0].element_size()):
        count, size = src.numel(), src.element_size()
        if count * size > piece_bytes:
            step = max(1, piece_bytes // size)
            flat_src, flat_dst = src.reshape(-1), dst.view(-1)
            out.extend([(flat_src[i : i + step], flat_dst[i : i + step])] for i in range(0, count, step))
            continue
        if count * size > room:
            batch, room = [], piece_bytes
            out.append(batch)
        batch.append((src, dst))
        room -= count * size
    return out


class _CopyWork:
    """Pieces to copy, taken in order by whichever thread is free (a counter: ``next`` on it is
    atomic under the GIL), and the errors the threads met."""

    def __init__(self, pieces: list[_Pairs], omp: ctypes.CDLL) -> None:
        self.pieces = pieces
        self.omp = omp
        self.errors: list[BaseException] = []
        self._next = itertools.count()

    def copy(self, done: threading.Lock | None) -> None:
        """Copy pieces on this thread until none is left, OpenMP at one thread for this thread
        meanwhile (torch then copies without a parallel region); then release ``done``."""
        try:
            torch.get_num_threads()  # ATen's per-thread OpenMP set-up first: it would undo ours
            before = self.omp.omp_get_max_threads()
            self.omp.omp_set_num_threads(1)
            try:
                with torch.no_grad():  # grad mode is per thread: no autograd history on a helper
                    for i in self._next:
                        if i >= len(self.pieces) or self.errors:
                            break
                        _copy_piece(self.pieces[i])
            finally:
                self.omp.omp_set_num_threads(before)
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread by _CopyThreads.run
            self.errors.append(exc)
        finally:
            if done is not None:
                done.release()


def _copy_piece(piece: _Pairs) -> None:
    """Copy one piece's pairs in one call (the GIL released once for all of them)."""
    if len(piece) == 1:
        piece[0][1].copy_(piece[0][0])
    else:
        copy_tensors([dst for _, dst in piece], [src for src, _ in piece])


def _versions(obj: Any, out: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    """Every tensor of a (nested) state dict with its version counter (which each in-place op, an
    optimizer step included, increments). Inference tensors have none and are left out."""
    if type(obj) is torch.Tensor:  # the common case first: this walk is what training waits for
        if not obj.is_inference():
            out.append((obj, obj._version))
    elif isinstance(obj, torch.Tensor):
        t = dtensor_local(obj) if DTensor is not None and type(obj) is DTensor else obj
        if not t.is_inference():
            out.append((t, t._version))
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
    counter: ~0.4 us a tensor), and returns an ``AsyncSaveResponse`` whose ``staging_completion``
    completes when the copy is done::

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
        # waits for it, and the exit waits for the save: uc_checkpoint.dcp.exit_guard).
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
        changed = sum(1 for t, v in versions if t._version != v)
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
