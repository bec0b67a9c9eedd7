"""CPU memory for ``dcp.async_save``'s snapshots, kept from one save to the next (opt-in).

A snapshot into new memory costs its page faults, several times the copy into memory already
mapped (docs/benchmarks-design.md, "Kept staging buffers"). :class:`StagingBuffers` keeps the tensors of the last snapshot after its save
has serialised them, and the next snapshot of the same state copies into them: the time
``async_save`` blocks training drops to about a copy between mapped pages. The price is memory held
between saves: one copy of the rank's state (what an async save holds while it runs anyway).

The same idea is DCP's ``BlockingAsyncStager(cache_staged_state_dict=True)`` and the pinned-memory
cache of its ``DefaultStager`` (torch 2.13). Unlike those, a set of buffers is lent to one save at a
time and comes back only when that save is done reading it (:meth:`BufferLease.release`): a save
that starts while the previous one still serialises gets new memory, never memory in use.
"""

from __future__ import annotations

import threading

import torch

from uc_checkpoint.volumes.process_local import ProcessLocal

#: One kept buffer: the tensor, whether it is in pinned memory (for accelerator sources), its dtype
#: and shape.
_Buffer = tuple[torch.Tensor, bool, torch.dtype, torch.Size]


class StagingBuffers:
    """A set of CPU tensors kept between async saves of the same state dict.

    Pass one object to every writer of a training run (or let :class:`~uc_checkpoint.CheckpointManager`
    keep it: ``staging=Staging(reuse_buffers=True)``)::

        buffers = StagingBuffers()
        for step in ...:
            dcp.async_save(state, storage_writer=UCVolumeWriter(url, staging_buffers=buffers))

    The first save allocates as usual; each later one copies into the previous one's tensors when
    it is done with them, matched in the order the snapshot walks the state (same shape, dtype and
    pinning; any that differ are allocated anew and replace the old). A save that starts while the
    previous one still serialises from the buffers gets new memory. Thread-safe. The set belongs to
    one process (a :class:`~uc_checkpoint.volumes.process_local.ProcessLocal`): a copy pickled to
    another process (the writer crosses to DCP's background process in PROCESS mode), a deep copy
    and a forked child start empty.

    Memory: between saves, :attr:`nbytes` bytes (the rank's state, tensors only) stay allocated;
    :meth:`clear` frees them.
    """

    def __init__(self) -> None:
        self._kept: ProcessLocal[_Kept] = ProcessLocal()

    def lease(self) -> BufferLease:
        """Lend the kept set (empty when none is idle: the first save, or the previous one is still
        running) to one snapshot; the set is the lease's until :meth:`BufferLease.release`."""
        kept = self._kept.get(_Kept)
        with kept.lock:
            idle, kept.idle = kept.idle, []
        return BufferLease(self, idle)

    @property
    def nbytes(self) -> int:
        """Bytes held by the idle set (0 while a save holds it, or before the first save ended)."""
        kept = self._kept.get(_Kept)
        with kept.lock:
            return sum(b[0].numel() * b[0].element_size() for b in kept.idle)

    def clear(self) -> None:
        """Free the idle set (a save holding one keeps it until it ends; it then comes back)."""
        kept = self._kept.get(_Kept)
        with kept.lock:
            kept.idle = []

    def _give_back(self, buffers: list[_Buffer]) -> None:
        kept = self._kept.get(_Kept)
        with kept.lock:
            # An empty set (a lease that was offered nothing, or a state without tensors) never
            # replaces a kept one that another save gave back meanwhile.
            if buffers or not kept.idle:
                kept.idle = buffers


class _Kept:
    """The idle set of a :class:`StagingBuffers` in one process, and its lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Buffer] = []


class BufferLease:
    """One snapshot's use of a :class:`StagingBuffers` set: :meth:`take` offers the next kept
    tensor in walk order, :meth:`keep` records what the snapshot used instead, :meth:`release` hands
    the snapshot's tensors back once nothing reads them."""

    def __init__(self, pool: StagingBuffers | None, offered: list[_Buffer]) -> None:
        self._pool = pool
        self._offered = offered
        self._used: list[_Buffer] = []
        self._released = False
        #: Kept tensors this snapshot copied into.
        self.reused = 0

    def take(self, like: torch.Tensor, pinned: bool) -> torch.Tensor | None:
        """The kept tensor at this point of the walk if it has ``like``'s shape and dtype and the
        given pinning (then it is used: the caller copies into it), else None (the caller allocates
        and passes its tensor to :meth:`keep`)."""
        offered, i = self._offered, len(self._used)
        if i < len(offered):
            kept = offered[i]
            # shape and dtype recorded with the buffer: reading them off the tensor is a call each,
            # most of this method's time for a state of thousands of small tensors
            if kept[2] is like.dtype and kept[3] == like.shape and kept[1] == pinned:
                self._used.append(kept)
                self.reused += 1
                return kept[0]
        return None

    def keep(self, t: torch.Tensor, pinned: bool) -> None:
        """Record a tensor the snapshot allocated at this point of the walk."""
        self._used.append((t, pinned, t.dtype, t.shape))

    def release(self) -> None:
        """The save no longer reads its snapshot: its tensors become the idle set (once; later
        calls do nothing)."""
        self._end(self._used)

    def cancel(self) -> None:
        """The snapshot failed: what was offered goes back (nothing else references it)."""
        self._end(self._offered)

    def _end(self, give_back: list[_Buffer]) -> None:
        if self._released:
            return
        self._released = True
        if self._pool is not None:
            self._pool._give_back(give_back)
        self._offered, self._used = [], []

    def forget(self) -> None:
        """The snapshot leaves with the save (DCP's PROCESS mode hands it to another process): the
        pool gets nothing back, and its next snapshot allocates anew."""
        self._released = True
        self._offered, self._used = [], []
