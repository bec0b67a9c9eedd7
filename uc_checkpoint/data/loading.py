"""The data tracker wired into ``torch.utils.data`` and DCP.

* :class:`TrackedShardDataset`: an ``IterableDataset`` whose workers read exactly the slices the
  :class:`~uc_checkpoint.data.tracker.DataTracker` hands them, seeking into shards (a user
  ``read_shard(shard, start, end)`` does the reading), and tag every item with the worker and the
  number of raw samples it covers.
* :class:`TrackedDataLoader`: wraps a ``torch.utils.data.DataLoader`` (or torchdata's
  ``StatefulDataLoader``), strips the tags and records consumption in the main process when a batch is
  handed to the training loop. It is a DCP ``Stateful``: put it in the state dict and the data position
  of every rank and worker is saved and published atomically with the model.
* :class:`TrackerStateful`: the same ``Stateful`` for a tracker fed by any other loader.

Usage (one per rank)::

    tracker = DataTracker(shards, seed=0, rank=rank, world_size=world, num_workers=4)
    loader = TrackedDataLoader(TrackedShardDataset(tracker, read_shard), batch_size=8, num_workers=4)
    state = {"model": ..., "data": loader}
    dcp.load(state, storage_reader=UCVolumeReader(path))          # restores and reshards the data work
    for epoch in range(tracker.epoch, epochs):
        tracker.start_epoch(epoch)
        for batch in loader:                                      # new iterator after start_epoch/load
            ...
            dcp.async_save(state, storage_writer=UCVolumeWriter(path))

Iterators and reloads: an iterator of :class:`TrackedDataLoader` reads the tracker's work as it was
when the iterator was created. ``tracker.start_epoch(...)`` (other than the one that continues a
restored epoch) and every load (``tracker.load_global_state``, ``loader.load_state_dict``, ``dcp.load``),
even of the very state already loaded, replace that work; an iterator created before then raises
:class:`DataLoadingError` at its next batch, and so does an iterator once a newer one of the same
loader was created. The next ``iter(loader)`` (a new ``for`` loop) reads the new work from its first
batch. So a load either shows in the next iterator's batches or is refused loudly; it never lets the
batches drift from what the tracker records.

Persistent workers (``persistent_workers=True``) keep their copy of the tracker across epochs: a
shared-memory control block tells them the current epoch, assignment and per-worker progress at every
new iterator, from which they recompute their slices. A :meth:`DataTracker.load_global_state` after
the workers started cannot be followed that way (the loaded work and seed are not in their copy); the
loader restarts its workers at the first iterator after any load (logged).

``drop_last=True`` needs ``DataTracker(..., batch_size=<the loader's batch_size>)``: the tracker then
cuts the work in whole batches, so an epoch drops the same ``total % batch_size`` samples however often
it is resumed (see ``docs/data-tracker.md``).
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from uc_checkpoint.data.digest import SampleDigest, ShardHasher
from uc_checkpoint.data.tracker import DataTracker, ShardSpec
from uc_checkpoint.data.worker_signals import (
    leave_stop_signals_to_the_rank,
    start_method_of,
    stop_signals_blocked_for,
)
from uc_checkpoint.errors import DataLoadingError, TrackerStateError

logger = logging.getLogger(__name__)

#: ``read_shard(shard, start, end)`` yields raw samples ``start .. end - 1`` of ``shard``, in order.
ShardReaderFn = Callable[[ShardSpec, int, int], Iterable[Any]]


def _id_to_int64(assignment_id: str) -> int:
    value = int(assignment_id, 16)  # 16 hex digits: 64 bits, stored two's-complement in an int64
    return value - (1 << 64) if value >= 1 << 63 else value


def _int64_to_id(value: int) -> str:
    return f"{value & ((1 << 64) - 1):016x}"


@dataclass(frozen=True)
class _Tagged:
    """An item on its way from a worker: its worker, how many raw samples it accounts for (1, plus
    any samples the transform dropped just before it) and their identities, ``[shard, sample index,
    ...]`` (empty with ``exactly_once="off"``)."""

    worker: int
    count: int
    item: Any
    ids: list[int]


@dataclass(frozen=True)
class _TaggedBatch:
    worker: int
    count: int
    batch: Any
    digest: SampleDigest | None


class _TaggingCollate:
    """Runs in the worker: collates the items, sums their raw-sample counts and hashes their sample
    identities into a digest (``hasher`` None: no digest). A class (not a closure) so that it pickles
    for spawn-started workers."""

    def __init__(
        self, collate_fn: Callable[[list[Any]], Any] | None, batched: bool, hasher: ShardHasher | None
    ) -> None:
        self.collate_fn = collate_fn
        self.batched = batched
        self.hasher = hasher

    def __call__(self, items: Any) -> _TaggedBatch:
        hasher = self.hasher
        if not self.batched:  # batch_size=None: one item at a time
            tagged: _Tagged = items
            item = tagged.item if self.collate_fn is None else self.collate_fn(tagged.item)
            return _TaggedBatch(tagged.worker, tagged.count, item, hasher.digest_of(tagged.ids) if hasher else None)
        workers = {t.worker for t in items}
        if len(workers) != 1:  # a batch is built by one worker from its own iterator
            raise DataLoadingError(f"a batch mixed items of workers {sorted(workers)}")
        collate = self.collate_fn or default_collate
        digest = None
        if hasher is not None:
            ids: list[int] = []
            for t in items:
                ids += t.ids
            digest = hasher.digest_of(ids)
        return _TaggedBatch(items[0].worker, sum(t.count for t in items), collate([t.item for t in items]), digest)


def _random_access(reader: Any) -> bool:
    """Whether ``reader`` can read samples by index: a callable ``read_indices`` and no
    ``random_access = False``."""
    return callable(getattr(reader, "read_indices", None)) and getattr(reader, "random_access", True) is not False


def _not_random_access(reader: Any) -> TypeError:
    return TypeError(
        f"shuffle_within_shard=True needs a random-access reader (read_indices(shard, indices), "
        f"random_access=True); {reader!r} ({type(reader).__name__}) is not one"
    )


def _raising(exc: Exception) -> Iterator[Any]:
    """An iterator that raises ``exc`` at its first ``next()``."""
    raise exc
    yield  # unreachable; makes this a generator function


class TrackedShardDataset(IterableDataset):
    """Reads the samples the tracker assigns to this rank's workers, and nothing else.

    Args:
        tracker: this rank's tracker; its ``num_workers`` must equal the loader's.
        read_shard: ``read_shard(shard, start, end)`` yields the raw samples ``start .. end - 1`` of
            ``shard`` (a :class:`ShardSpec`) in order, seeking to ``start`` rather than reading and
            discarding. It must yield at least ``end - start`` items (extra ones are not read);
            fewer raises :class:`DataLoadingError` naming the shard. It runs in the worker processes,
            so it must pickle when workers are spawned.
            With ``shuffle_within_shard`` the reader must also have ``read_indices(shard, indices)``
            (yielding the samples at the given sample indices, in that order) and no
            ``random_access = False``; each interval of positions is read through it, mapped by
            :meth:`DataTracker.sample_indices`.
        transform: optional ``transform(sample)``, run in the worker; returning None drops the sample
            (its raw-sample count is carried by the next item, so that progress stays in raw samples).
        sample_index: optional ``sample_index(sample) -> int``, the index within its shard of a sample
            as the reader returned it (e.g. a field the reader fills in). Given, the exactly-once
            digest hashes what the reader really returned, so that a reader that skips or repeats a
            record is caught at the epoch's end; without it the digest hashes the index the worker
            asked for, which checks the tracking (slices, resumes, records), not the reader.

    Iterating it outside :class:`TrackedDataLoader` yields tagged items; use the loader.

    Raises:
        TypeError: ``read_shard`` is not callable, or the tracker shuffles within shards and the
            reader is not random-access (names the reader).
    """

    def __init__(
        self,
        tracker: DataTracker,
        read_shard: ShardReaderFn,
        transform: Callable[[Any], Any] | None = None,
        *,
        sample_index: Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(tracker, DataTracker):
            raise TypeError(f"tracker must be a DataTracker, got {type(tracker).__name__}")
        if not callable(read_shard):
            raise TypeError("read_shard must be callable: read_shard(shard, start, end) -> iterable of samples")
        if tracker.config.shuffle_within_shard and not _random_access(read_shard):
            raise _not_random_access(read_shard)
        self.tracker = tracker
        self.read_shard = read_shard
        self.transform = transform
        self.sample_index = sample_index
        # [assignment id as int, epoch, next worker, consumed per worker...], in shared memory so that
        # persistent workers (forked or spawned) see the main process's updates.
        self._control = torch.zeros(3 + tracker.config.workers_per_rank, dtype=torch.int64).share_memory_()
        self.publish_progress()

    def publish_progress(self) -> None:
        """Copy the main-process tracker's epoch, assignment, next worker and per-worker progress into
        the control block the workers read when they start iterating. :class:`TrackedDataLoader`
        calls it."""
        t = self.tracker
        self._control[0] = _id_to_int64(t.assignment_id)
        self._control[1] = t.epoch
        self._control[2] = t.next_worker
        self._control[3:] = torch.tensor([t.samples_consumed(w) for w in range(t.config.workers_per_rank)])

    def __iter__(self) -> Iterator[_Tagged]:
        info = get_worker_info()
        if info is not None and info.num_workers != self.tracker.config.num_workers:
            raise DataLoadingError(
                f"the DataLoader has num_workers={info.num_workers} but the DataTracker was built with "
                f"num_workers={self.tracker.config.num_workers}"
            )
        if info is None and self.tracker.config.num_workers != 0:
            raise DataLoadingError(
                f"the DataLoader reads in the main process (num_workers=0) but the DataTracker was built "
                f"with num_workers={self.tracker.config.num_workers}"
            )
        tracker = self.tracker
        worker = 0
        if info is not None:  # a worker's copy: catch up with the main process
            control = self._control.tolist()
            # The DataLoader takes batches from its workers 0, 1, ... in turn: its worker i reads
            # tracker worker (next + i) % N, so that the turn goes on with the worker due next (after
            # the last batch handed out, or as a resumed run saved it).
            worker = (info.id + control[2]) % info.num_workers
            if not tracker.sync_from_main_process(control[1], _int64_to_id(control[0]), control[3:]):
                # Raised at the first item, not here: a persistent worker calls iter() outside the
                # DataLoader's error forwarding and would die ("worker exited unexpectedly"), while
                # an error from next() reaches the training loop as this DataLoadingError.
                return _raising(
                    DataLoadingError(
                        f"data-loader worker {worker} cannot follow a DataTracker.load_global_state() made "
                        "after it started (its copy of the tracker lacks the loaded work); restart the "
                        "workers: TrackedDataLoader does so at the first iterator after a load, a loader of "
                        "your own must not keep persistent workers across a load"
                    )
                )
        return self._read(tracker, worker)

    def _read(self, tracker: DataTracker, worker: int) -> Iterator[_Tagged]:
        pending = 0  # raw samples read but not yet carried by a yielded item
        ids: list[int] = []  # their identities: shard, index, shard, index, ...
        collect = tracker.config.exactly_once != "off"
        shuffled = tracker.config.shuffle_within_shard
        if shuffled and not _random_access(self.read_shard):
            raise _not_random_access(self.read_shard)
        for iv in tracker.consumer_slices(worker):
            shard = tracker.config.shards[iv.shard]
            got = 0
            if iv.size:
                indices = tracker.sample_indices(iv) if shuffled else None
                if indices is not None:
                    source = self.read_shard.read_indices(shard, indices)  # type: ignore[attr-defined]
                else:
                    source = self.read_shard(shard, iv.start, iv.end)
                for sample in source:
                    if collect:
                        if self.sample_index is not None:
                            index = self._checked_index(sample, shard)
                        else:
                            index = iv.start + got if indices is None else int(indices[got])
                        ids += (iv.shard, index)
                    got += 1
                    pending += 1
                    item = sample if self.transform is None else self.transform(sample)
                    if item is not None:
                        yield _Tagged(worker, pending, item, ids)
                        pending = 0
                        ids = []
                    if got == iv.size:
                        break
            if got < iv.size:
                raise DataLoadingError(
                    f"read_shard({shard.name!r}, {iv.start}, {iv.end}) yielded {got} samples, expected "
                    f"{iv.size} (the shard has {shard.num_samples} according to its ShardSpec)"
                )
        # Samples dropped by the transform at the very end are accounted for when the loader's
        # iterator is exhausted (see TrackedDataLoader.__iter__).

    def _checked_index(self, sample: Any, shard: ShardSpec) -> int:
        """``sample_index(sample)``, checked to be an index of ``shard``."""
        assert self.sample_index is not None
        index = self.sample_index(sample)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < shard.num_samples:
            raise DataLoadingError(
                f"sample_index() returned {index!r} for a sample of shard {shard.name!r}, which has "
                f"{shard.num_samples} samples"
            )
        return index


class TrackerStateful:
    """DCP ``Stateful`` for a :class:`DataTracker`: saves the data state of *all* ranks.

    ``state_dict()`` all-gathers every rank's :meth:`DataTracker.local_state` over ``process_group``
    (a collective: every rank of the group must call it, which DCP's save and load do) and returns
    ``{"global_state": <JSON text of DataTracker.global_state>}``, the same on every rank, so that DCP
    stores it once. ``load_state_dict`` restores it with :meth:`DataTracker.load_global_state`, which
    reshards the remaining work for this run's world size and workers.

    Args:
        tracker: this rank's tracker.
        process_group: the data-parallel group whose ranks the tracker's ``rank``/``world_size``
            describe (default: the default group; none needed when torch.distributed is not
            initialised and ``world_size == 1``).
        include_shard_list: store the ``[name, num_samples]`` list of all shards (about
            ``len(name) + 10`` bytes each) so that a dataset mismatch names the shard; turn off for
            very many shards.

    Raises (from ``state_dict``):
        DataLoadingError: the group's size differs from the tracker's ``world_size``.
    """

    def __init__(
        self, tracker: DataTracker, process_group: dist.ProcessGroup | None = None, *, include_shard_list: bool = True
    ) -> None:
        self.tracker = tracker
        self.process_group = process_group
        self.include_shard_list = include_shard_list

    def _gather(self) -> list[dict[str, Any]]:
        local = self.tracker.local_state()
        if not (dist.is_available() and dist.is_initialized()):
            if self.tracker.config.world_size != 1:
                raise DataLoadingError(
                    f"DataTracker has world_size={self.tracker.config.world_size} but torch.distributed is not "
                    "initialised: the data state of the other ranks cannot be gathered"
                )
            return [local]
        size = dist.get_world_size(self.process_group)
        if size != self.tracker.config.world_size:
            raise DataLoadingError(
                f"DataTracker has world_size={self.tracker.config.world_size} but its process group has {size} "
                "ranks (pass the data-parallel group as process_group)"
            )
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, local, group=self.process_group)
        return gathered

    def state_dict(self) -> dict[str, Any]:
        """``{"global_state": str}``: JSON of :meth:`DataTracker.global_state` over all ranks."""
        state = self.tracker.global_state(self._gather(), include_shard_list=self.include_shard_list)
        return {"global_state": json.dumps(state, separators=(",", ":"))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output (of a run with any world size or workers).

        Raises:
            DatasetMismatchError: the state belongs to a different dataset (see the tracker).
            TrackerStateError: (a ``ValueError``) ``state_dict`` is not one this class wrote: no
                ``global_state`` text, not JSON, or a malformed tracker state (the message names the
                field).
        """
        raw = state_dict.get("global_state") if isinstance(state_dict, dict) else None
        if not isinstance(raw, str):
            raise TrackerStateError(
                f"not a TrackerStateful state dict (no 'global_state' text): {type(state_dict).__name__}"
            )
        try:
            state = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise TrackerStateError(f"data tracker state 'global_state' is not valid JSON: {exc!r}") from None
        self.tracker.load_global_state(state)
        for line in _describe_resume(self.tracker):
            logger.info("%s", line)


def _describe_resume(tracker: DataTracker) -> list[str]:
    s = tracker.resume_summary()
    lines = [
        f"data tracker: resumed epoch {s['epoch']}: {s['samples_consumed_in_epoch']} samples consumed, "
        f"{s['samples_remaining']} remaining; {s['skipped_shards']} shards skipped "
        f"{s['skipped_names']}{' ...' if s['skipped_shards'] > len(s['skipped_names']) else ''}"
    ]
    lines += [
        f"data tracker: rank {r} worker {w} seeks to sample {o} of {name!r}"
        for r, w, name, o in s["seeks"]
        if r == tracker.config.rank
    ]
    return lines


class _TrackedIterator:
    """One pass over a :class:`TrackedDataLoader`: hands out batches and records them as consumed.

    It is bound to the tracker's work at the time it was created, which is what its workers read.
    Once that work is replaced (:attr:`DataTracker.generation` moved) or a newer iterator of the same
    loader was created, every further ``next()`` raises :class:`DataLoadingError`: a batch handed out
    then would be recorded against work it does not belong to.
    """

    def __init__(self, tracker: DataTracker, loader: Any) -> None:
        self._tracker = tracker
        self._generation = tracker.generation
        self._epoch = tracker.epoch
        with stop_signals_blocked_for(start_method_of(loader)):  # spawned workers block them from their start
            self._it: Iterator[_TaggedBatch] | None = iter(loader)
        self._refusal: str | None = None
        self._finished = False

    def __iter__(self) -> _TrackedIterator:
        return self

    def _retire(self, why: str) -> None:
        self._refusal = why
        # Dropping the DataLoader iterator lets non-persistent workers shut down now rather than
        # prefetching for a pass nobody will finish.
        self._it = None

    def __next__(self) -> Any:
        """The next batch, recorded as consumed.

        Raises:
            StopIteration: the pass is over (every sample of this rank's slices was read).
            DataLoadingError: the tracker's work was replaced since this iterator was created, or a
                newer iterator of the loader exists; create a new one with ``iter(loader)``.
        """
        if self._finished:
            raise StopIteration
        tracker = self._tracker
        if self._refusal is None and tracker.generation != self._generation:
            self._retire(
                f"this loader iterator was created for epoch {self._epoch} (tracker generation "
                f"{self._generation}), but the DataTracker's work changed since (start_epoch() or "
                f"load_global_state()/load_state_dict(); now epoch {tracker.epoch}, generation "
                f"{tracker.generation}) while a loader iterator was running. Its workers read the old "
                "work, so its batches would not be the samples the tracker records. Create a new "
                "iterator: iter(loader) (a new `for batch in loader` loop)."
            )
        if self._refusal is not None:
            raise DataLoadingError(self._refusal)
        assert self._it is not None  # only _retire and the end of the pass clear it
        try:
            tagged = next(self._it)
        except StopIteration:
            self._finished = True
            self._it = None
            # Every sample of this rank's slices was read: what is still unrecorded was dropped in
            # the workers after their last item (by the transform, or as drop_last's partial batch).
            for w in range(tracker.config.workers_per_rank):
                left = tracker.samples_left(w)
                if left:
                    tracker.record(w, left)
            if tracker.config.world_size == 1:
                tracker.epoch_done()  # the one rank has finished the epoch: the exactly-once check runs
            raise
        tracker.record(tagged.worker, tagged.count, tagged.digest)
        return tagged.batch


class _WorkerInit:
    """A DataLoader ``worker_init_fn``: the worker leaves the stop signals to its rank, the process
    ``rank_pid`` that creates the workers
    (:func:`~uc_checkpoint.data.worker_signals.leave_stop_signals_to_the_rank`), then runs
    ``then(worker_id)`` if given. Picklable for spawned workers."""

    def __init__(self, then: Callable[[int], Any] | None, rank_pid: int) -> None:
        self.then = then
        self.rank_pid = rank_pid

    def __call__(self, worker_id: int) -> None:
        leave_stop_signals_to_the_rank(self.rank_pid)
        if self.then is not None:
            self.then(worker_id)


class TrackedDataLoader:
    """A DataLoader over a :class:`TrackedShardDataset` that records consumption as batches are
    handed out, and a DCP ``Stateful`` (see :class:`TrackerStateful`).

    Args:
        dataset: the tracked dataset.
        loader_cls: ``torch.utils.data.DataLoader`` (default) or a compatible class such as
            ``torchdata.stateful_dataloader.StatefulDataLoader``. Its own state dict is not needed: the
            tracker's state is topology-independent, the loader's per-worker snapshots are not.
        process_group, include_shard_list: see :class:`TrackerStateful`.
        collate_fn: collates a list of items into a batch (default ``default_collate``); runs in the
            workers.
        **loader_kwargs: passed to ``loader_cls`` (``batch_size``, ``num_workers`` (must equal the
            tracker's), ``persistent_workers``, ``prefetch_factor``, ``pin_memory``, ``drop_last``,
            ...). ``shuffle``, ``sampler`` and ``batch_sampler`` are refused: the order is the
            tracker's.

    A sample counts as consumed when the batch holding it is yielded to the training loop: batches
    prefetched by workers but not yet yielded at a save are read again after a resume. When the
    iterator is exhausted every sample of this rank's slices was read, so the tracker records the
    rank's work as finished (covering samples a transform dropped at the very end, and the partial
    batch each worker drops with ``drop_last=True``).

    Each ``iter(loader)`` reads the tracker's work as it is at that moment. After
    ``tracker.start_epoch`` (except the call that continues a restored epoch) or any load
    (:meth:`load_state_dict`, ``tracker.load_global_state``, ``dcp.load``; also of the state already
    loaded), iterators created before it raise :class:`DataLoadingError` at their next batch;
    creating a new iterator retires the older ones the same way. Persistent workers are restarted at
    the first iterator after a load and kept otherwise.

    ``drop_last=True`` drops each worker's last partial batch. It needs a tracker built with
    ``batch_size=`` the loader's batch size, which cuts the work in whole batches so that an epoch
    drops the same ``total % batch_size`` samples whether or not it was interrupted and resumed.

    Workers leave the signals that stop a job
    (:data:`~uc_checkpoint.data.worker_signals.WORKER_STOP_SIGNALS`: SIGTERM, SIGINT, SIGHUP,
    SIGQUIT, SIGUSR1, SIGUSR2) to their rank, before any ``worker_init_fn`` given runs: one
    sent by anyone but the rank is ignored, so a stop sent to every process of a job (torchrun
    passing SIGTERM on to a rank's process group, ``kill -TERM -- -<pgid>``, Slurm, a cgroup or pod
    stop) reaches the rank, which finishes its step and takes its final checkpoint, while the workers
    go on serving its batches. Workers end with the rank (its DataLoader shutting them down, a stop
    signal from the rank itself, or the DataLoader's watchdog once the rank is gone). Linux and
    other systems with ``sigwaitinfo``; elsewhere workers keep torch's handlers.

    Batches come from the DataLoader's workers in turn; each new iterator starts the turn at the
    tracker's :attr:`~DataTracker.next_worker` (its DataLoader worker ``i`` reads tracker worker
    ``(i + next_worker) % num_workers``). Together with the per-consumer cut a checkpoint keeps
    (:mod:`uc_checkpoint.data.layout`), a run resumed on the same world size, workers and batch size
    gets the very batches the uninterrupted run got, whatever step it stopped at. On another world
    size or worker count the remaining work is cut evenly and each rank starts at worker 0. Random
    draws inside workers (a random transform) restart from the workers' seeds at every new iterator.

    Unless ``generator=`` is given, the loader gets a private ``torch.Generator`` seeded from the
    tracker's seed: a plain DataLoader draws from torch's global RNG at every new iterator, so
    creating one after restoring the RNG on resume would change every later random draw (dropout)
    and break bit-exact resumption.

    Raises:
        DataLoadingError: ``num_workers`` differs from the tracker's; ``drop_last=True`` with a tracker
            whose ``batch_size`` is not the loader's; a reader broke its contract; a stale iterator
            was used (see above).
        TypeError: ``shuffle``/``sampler``/``batch_sampler`` given.
    """

    def __init__(
        self,
        dataset: TrackedShardDataset,
        *,
        loader_cls: type = DataLoader,
        process_group: dist.ProcessGroup | None = None,
        include_shard_list: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        if not isinstance(dataset, TrackedShardDataset):
            raise TypeError(f"dataset must be a TrackedShardDataset, got {type(dataset).__name__}")
        for banned in ("shuffle", "sampler", "batch_sampler"):
            if loader_kwargs.get(banned):
                raise TypeError(f"TrackedDataLoader does not take {banned}=: the DataTracker decides the order")
        num_workers = loader_kwargs.get("num_workers", 0)
        if num_workers != dataset.tracker.config.num_workers:
            raise DataLoadingError(
                f"num_workers={num_workers} but the DataTracker was built with num_workers="
                f"{dataset.tracker.config.num_workers}: each worker is one consumer of the tracker"
            )
        batch_size = loader_kwargs.get("batch_size", 1)  # DataLoader's default
        batched = batch_size is not None
        if loader_kwargs.get("drop_last") and batched and dataset.tracker.config.batch_size != batch_size:
            # Every worker would drop its own partial batch, and a resume re-cuts the work into new
            # partial batches: an interrupted epoch would lose more samples than an uninterrupted one.
            raise DataLoadingError(
                f"drop_last=True with batch_size={batch_size} needs a DataTracker built with "
                f"batch_size={batch_size} (it has batch_size={dataset.tracker.config.batch_size}), so that the "
                "work is cut in whole batches and a resumed epoch drops no more samples than an "
                "uninterrupted one; or use drop_last=False and handle the short last batch of each worker"
            )
        self.dataset = dataset
        self.tracker = dataset.tracker
        self._stateful = TrackerStateful(dataset.tracker, process_group, include_shard_list=include_shard_list)
        self._loader_cls = loader_cls
        if loader_kwargs.get("generator") is None:
            # Without a generator of its own a DataLoader draws its workers' base seed from torch's
            # global RNG at every new iterator, which shifts dropout etc. by where iterators happen
            # to be created: a resumed run (new iterator after the RNG was restored) would diverge.
            loader_kwargs["generator"] = torch.Generator().manual_seed(dataset.tracker.config.seed)
        hasher = (
            None
            if dataset.tracker.config.exactly_once == "off"
            else ShardHasher([s.name for s in dataset.tracker.config.shards])
        )
        self._loader_kwargs = dict(
            loader_kwargs,
            collate_fn=_TaggingCollate(collate_fn, batched, hasher),
            worker_init_fn=_WorkerInit(loader_kwargs.get("worker_init_fn"), os.getpid()),
        )
        self._persistent = bool(loader_kwargs.get("persistent_workers", False))
        self._loader: Any = None
        self._workers_load_count = 0  # tracker.load_count when the persistent workers were started
        self._current: weakref.ref[_TrackedIterator] | None = None

    def _get_loader(self) -> Any:
        if self._loader is not None and self._persistent and self._workers_load_count != self.tracker.load_count:
            # The workers' tracker copies predate a load: they can follow new epochs, not loaded work
            # (nor a loaded seed), whatever the assignment looks like now.
            logger.info("data loader: restarting persistent workers to pick up the loaded data state")
            self._loader = None
        if self._loader is None:
            self._loader = self._loader_cls(self.dataset, **self._loader_kwargs)
            self._workers_load_count = self.tracker.load_count
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        """A new pass over this rank's remaining work (see the class docs for what retires it)."""
        previous = self._current() if self._current is not None else None
        if previous is not None:
            # With persistent workers both would drive the same DataLoader iterator; without, both
            # would read the same unconsumed samples. Either way samples would be handed out twice.
            previous._retire(
                "a newer iterator of this TrackedDataLoader was created after this one; only the newest "
                "one hands out batches (two would read the same samples). Use the new iterator."
            )
        self.dataset.publish_progress()
        it = _TrackedIterator(self.tracker, self._get_loader())
        self._current = weakref.ref(it)
        return it

    # DCP Stateful
    def state_dict(self) -> dict[str, Any]:
        """See :meth:`TrackerStateful.state_dict` (a collective over the process group)."""
        return self._stateful.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See :meth:`TrackerStateful.load_state_dict`; the next iterator reads the restored work, and
        iterators created before the load refuse to go on (:class:`DataLoadingError`)."""
        self._stateful.load_state_dict(state_dict)


__all__ = ["ShardReaderFn", "TrackedDataLoader", "TrackedShardDataset", "TrackerStateful"]
