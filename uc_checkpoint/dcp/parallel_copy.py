"""The big CPU tensor copies of one snapshot, made on threads of our own with OpenMP at one thread.

Why not leave them to torch: with OpenMP, torch splits a big copy over its pool threads, which keep
spinning on their cores for a while after the copy; that delays the thread ``dcp.async_save``
starts next, and with it the moment training gets back. And OpenMP splits a copy into equal shares
up front, so on a busy host the copy waits for the thread whose core is taken; here each thread
takes the next piece when it is free. Figures: docs/benchmarks-staging.md, "The snapshot's copy
threads".

Used by :func:`uc_checkpoint.dcp.stager.cpu_snapshot` through :class:`CopyThreads`. Linux and
torch built with OpenMP only: elsewhere, or when the runtime cannot be found, every copy is left
to torch.
"""

from __future__ import annotations

import _thread
import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Iterator

import torch

from uc_checkpoint.dcp.buffers import BufferLease
from uc_checkpoint.dcp.compat import copy_tensors

_CONTIGUOUS = torch.contiguous_format
#: Tensors of at least this many elements are queued for the copy threads; torch copies smaller
#: ones on the calling thread alone anyway (ATen's ``GRAIN_SIZE``), so they are cloned at once.
_THREADED_MIN_NUMEL = 32768
#: Bytes queued per copy thread at least, so that starting a thread costs little next to its share.
_BYTES_PER_COPY_THREAD = 4 << 20
#: Most bytes one copy thread takes at a time (a bigger tensor is cut into flat views; smaller ones
#: go together, copied in one call).
_COPY_PIECE_BYTES = 2 << 20


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's CPU kernels run on, for setting one thread's OpenMP thread count
    (``omp_set_num_threads`` sets it for the calling thread only, unlike ``torch.set_num_threads``,
    which also changes every other thread's and clears oneDNN's primitive cache). None when torch
    does not use OpenMP or the runtime cannot be found (then :class:`CopyThreads` leaves every copy
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


class CopyThreads:
    """The copies of one snapshot that torch would split over OpenMP threads, made on threads of
    our own instead, each with OpenMP at one thread: the calling thread and up to
    ``torch.get_num_threads() - 1`` helpers (one per :data:`_BYTES_PER_COPY_THREAD` queued), which
    end with the copy. The threads take pieces of at most :data:`_COPY_PIECE_BYTES` from one list
    until none is left (a thread that started later or faults more slowly takes fewer), so the copy
    takes about what torch's own takes, but no OpenMP thread is left spinning afterwards.

    :meth:`clone` allocates a tensor's copy and, for a big contiguous tensor, queues the copy;
    :meth:`run` makes the queued copies. Without an OpenMP runtime to set (:func:`_openmp`), or with
    one thread, :meth:`clone` copies at once, as ``Tensor.clone`` does.

    Args:
        buffers: tensors kept from an earlier snapshot, which copies go into where one fits (see
            :func:`~uc_checkpoint.dcp.stager.cpu_snapshot`).
    """

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
            # clone (under no_grad: no autograd history) allocates and copies in one dispatch,
            # where empty + copy_ + detach take three.
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
            # where a helper costs more than it gives (docs/benchmarks-staging.md, "The snapshot's
            # copy threads").
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
            # The low-level start: threading.Thread.start waits until the new thread runs, time
            # this thread spends copying instead; each helper releases its lock last.
            try:
                _thread.start_new_thread(work.copy, (lock,))
            except RuntimeError:  # no thread to be had (limits, interpreter exit): the others copy its share
                lock.release()
        work.copy(None)
        for lock in done:
            lock.acquire()
        if work.errors:
            raise work.errors[0]


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
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread by CopyThreads.run
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
