"""Which data samples a training run has consumed: exactly once per epoch, across restarts that
change the number of ranks or data-loader workers.

Model
=====

A dataset is an ordered list of shards (files, objects, table partitions), each holding
``num_samples`` raw samples numbered ``0 .. num_samples - 1``. Everything here counts *raw* samples,
i.e. records as stored in the shard, before any filtering, tokenising or packing.

* **Epoch order.** Epoch ``e`` visits the shards in the permutation :func:`epoch_shard_order` derives
  from ``(seed, e)``. The epoch's *stream* is the concatenation, in that order, of each shard's samples
  ``0 .. n-1``. (Shuffling samples inside a shard, if wanted, is the reader's business: the offsets
  tracked here are positions in the order the reader reads a shard, which must be the same on resume.)
* **Remaining work** is a list of :class:`Interval` ``(shard, start, end)`` (half-open ranges of raw
  samples of one shard) in stream order. At the start of an epoch it is the whole stream.
* **Consumers.** Every data-loader worker of every rank is one consumer, numbered
  ``rank * workers_per_rank + worker`` where ``workers_per_rank = max(1, num_workers)`` (with
  ``num_workers=0`` the rank's main process is its single consumer, worker 0). :func:`assign` cuts the
  remaining work, in stream order, into one contiguous slice per consumer; slice sizes differ by at most
  one sample, the first consumers getting the extra ones. (With ``DataTracker(batch_size=b)`` the cut
  is in whole batches of ``b`` samples instead, with at most one partial batch in the whole run: see
  ``drop_last`` below.)
* **Progress** of a consumer is a single integer: how many samples of its slice it has consumed. A
  consumer reads its slice in order and the training loop consumes one worker's output in the order the
  worker produced it, so what was consumed is always a *prefix* of the slice. The rank's progress
  (:meth:`DataTracker.local_state`) is one integer per worker.
* **Checkpoint.** All ranks' progress is gathered and turned into the global state
  (:meth:`DataTracker.global_state`): the remaining work (every slice minus its consumed prefix), the
  epoch, the seed and a dataset fingerprint. It does not mention ranks or workers, so it can be loaded
  by a run with any world size and any number of workers (:meth:`DataTracker.load_global_state`), which
  cuts the remaining work afresh for its own consumers. Its size grows with the number of shards and
  consumers (the remaining work is at most about ``shards + consumers`` intervals when consumers
  progress evenly), never with the number of samples.

Why this shape: per-worker or per-rank iterator snapshots (torchdata's StatefulDataLoader, HF
``datasets``, DALI) cannot be loaded by a different topology, and a single global sample count
(Megatron, MosaicML Streaming) is exact only when every rank consumed the same number of samples and the
order is a function of the topology. A global remaining-work list is exact for any interleaving of
per-consumer progress and independent of the topology that produced it.

Wiring it into a training loop
==============================

One :class:`DataTracker` per rank, living in the training process::

    tracker = DataTracker(shards, seed=seed, rank=rank, world_size=world, num_workers=nw)
    if resuming:
        tracker.load_global_state(checkpoint["data"])
    for epoch in range(tracker.epoch, num_epochs):
        tracker.start_epoch(epoch)       # keeps the restored progress when this is the restored epoch
        for item in make_loader(tracker):        # a fresh iterator after every start_epoch/load
            tracker.record(item.worker, item.raw_samples)   # when the sample is really consumed
            ...
            if saving:
                local_states = all_gather_object(tracker.local_state())
                checkpoint["data"] = tracker.global_state(local_states)   # same dict on every rank

* Worker ``w`` of the loader reads ``tracker.consumer_slices(w)`` (e.g. via :func:`iter_positions`)
  and tags what it yields with ``w`` and the number of raw samples the item covers (a sample the worker
  filtered out is counted in the next item it yields, so that counts stay in raw samples).
* Call :meth:`DataTracker.record` where samples are consumed by training, not where they are
  prefetched: samples sitting in a prefetch queue at save time are not consumed and will be read again
  after a resume, which is what exactly-once requires.
* The loader's workers get a copy of the tracker when its iterator is created, so create a new
  iterator after :meth:`DataTracker.start_epoch` and :meth:`DataTracker.load_global_state`: both
  replace the work (even a reload of the very state the tracker holds resets its progress) and bump
  :attr:`DataTracker.generation` (except the ``start_epoch`` that continues a restored epoch, which
  changes nothing). ``TrackedDataLoader`` refuses to go on with an iterator created
  before the bump (``DataLoadingError`` at its next batch) rather than hand out batches of the old
  work that the tracker would record against the new one. A new iterator of the same assignment
  starts each worker at its recorded position (what was prefetched but not consumed is read again).
* Persistent workers (``persistent_workers=True``) are supported by ``TrackedDataLoader``: at every
  new iterator they read the main process's epoch, assignment and progress from a shared control
  block and follow a new epoch themselves (its work is a function of ``(seed, epoch)``); they cannot
  follow a :meth:`DataTracker.load_global_state` (their copy lacks the loaded work and seed), so the
  loader restarts them at the first iterator after any load (:attr:`DataTracker.load_count`). A
  loader of your own must do the same or not keep workers across a load.
* ``drop_last``: a loader that batches in its workers drops each worker's last partial batch; the
  dropped samples count as consumed when the iterator ends (read zero times, like any ``drop_last``).
  With slices cut per sample every consumer may end on a partial batch, and a resume re-cuts the work
  into new partial batches, so an interrupted epoch would drop more than an uninterrupted one. Build
  the tracker with ``batch_size=`` the loader's batch size: every slice but one in the whole run is
  then whole batches, the run's consumed counts stay multiples of the batch size at every save, and
  an epoch drops exactly ``total % batch_size`` samples (with an unchanged batch size and a transform
  that drops nothing) however often and onto whatever topology it is resumed.
  ``TrackedDataLoader(drop_last=True)`` refuses a tracker without it.
* Save the global state in the same atomic checkpoint as the model: progress recorded after a save is
  lost together with the model updates it fed, and the samples are read again after the resume.

Uneven ends
===========

Slices differ by at most one sample (one batch with ``batch_size``), so when an epoch is started on a
fresh dataset a rank gets at most ``workers_per_rank`` samples (batches) more than another; after a
resume the remaining work is re-balanced the same way. A consumer whose slice is used up yields nothing more in this epoch
(:meth:`DataTracker.consumer_slices` is empty, :meth:`DataTracker.rank_exhausted` turns true), while
other ranks may still hold a few samples. Synchronous data-parallel training must not let one rank stop
stepping while others continue (collectives would hang), so the loop has to choose one of:

1. *Exactly once, padded*: ranks that ran dry take an empty or zero-weight batch (or use DDP's
   ``Join`` context) until :meth:`DataTracker.epoch_done` reports the epoch finished on all ranks.
2. *Lock-step stop, then drop*: all-reduce "this rank still has data" every step and stop all ranks
   when any rank is exhausted; then :meth:`DataTracker.start_epoch` for the next epoch discards the few
   leftover samples (a warning names how many this rank drops). Those samples are read zero times in
   this epoch, like ``drop_last``.
3. *Lock-step stop, then re-balance*: as in 2, but save and reload the global state (or call
   ``load_global_state(global_state(...))`` on every rank) to spread the leftovers over all consumers
   again; repeat until fewer samples than consumers remain, then pad or drop as in 1 or 2.

Resuming and resharding
=======================

:meth:`DataTracker.load_global_state` restores the epoch and the remaining work and re-assigns it to
*this* run's ``world_size * workers_per_rank`` consumers. The set of samples still to be read in the
epoch is exactly the saved remaining work, whatever the old and new topologies were; which rank reads
which of them changes when the topology changes. When the topology is unchanged and every consumer had
consumed the same number of samples (lock-step), each consumer gets back exactly the rest of its old
slice, so the resumed run reads what the uninterrupted run would have. Saving straight after a resume,
several resumes in a row and a resume at an epoch boundary (empty remaining work) all go through the
same path.

The first :meth:`DataTracker.start_epoch` after a load, if it names the restored epoch, keeps the
restored work instead of restarting the epoch: the usual ``for epoch in range(tracker.epoch, n):
tracker.start_epoch(epoch)`` loop then resumes mid-epoch instead of replaying the epoch (a bug several
loaders have had).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import DatasetMismatchError, TrackerStateError

logger = logging.getLogger(__name__)

#: Version of the dict :meth:`DataTracker.global_state` returns.
STATE_FORMAT = 1

# Domain tags keep these hashes distinct from any other sha256 of similar text.
_FINGERPRINT_TAG = b"uc_checkpoint.data_tracker.fingerprint.v1\n"
_ORDER_TAG = "uc_checkpoint.data_tracker.order.v1"
_ASSIGNMENT_TAG = b"uc_checkpoint.data_tracker.assignment.v1\n"
#: Keys every saved state has (``shards`` is optional).
_STATE_KEYS = frozenset(
    {"format", "fingerprint", "seed", "epoch", "remaining", "samples_consumed_in_epoch", "num_shards"}
)


def _check_int(value: Any, what: str, *, minimum: int | None = None) -> int:
    # bool is an int subclass; True as a sample count is almost certainly a bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _state_int(value: Any, field: str, *, minimum: int | None = None) -> int:
    """``value`` as a field of a saved or gathered state: an int (not a bool) of at least
    ``minimum``, else :class:`TrackerStateError` naming ``field``. (Arguments of the API go through
    :func:`_check_int`, whose TypeError/ValueError suit a caller's mistake; a state is data.)"""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TrackerStateError(f"data tracker state: {field} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise TrackerStateError(f"data tracker state: {field} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class ShardSpec:
    """One shard of the dataset: its name (unique id such as a path or URL) and how many raw samples
    it holds."""

    name: str
    num_samples: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"ShardSpec.name must be a str, got {type(self.name).__name__}")
        _check_int(self.num_samples, f"ShardSpec({self.name!r}).num_samples", minimum=0)


@dataclass(frozen=True)
class Interval:
    """Raw samples ``start .. end - 1`` of shard number ``shard`` (index into the dataset's shard
    list, not a position in the epoch order)."""

    shard: int
    start: int
    end: int

    def __post_init__(self) -> None:
        _check_int(self.shard, "Interval.shard", minimum=0)
        _check_int(self.start, "Interval.start", minimum=0)
        _check_int(self.end, "Interval.end", minimum=0)
        if self.end < self.start:
            raise ValueError(f"Interval end {self.end} < start {self.start}")

    @property
    def size(self) -> int:
        """Number of samples in the interval."""
        return self.end - self.start


def dataset_fingerprint(shards: Sequence[ShardSpec]) -> str:
    """Hex sha256 over the shard names and sample counts, in order.

    Reordering, renaming, resizing, adding or removing a shard changes it. Each name is length-prefixed
    so that no two different shard lists encode to the same bytes.
    """
    h = hashlib.sha256(_FINGERPRINT_TAG)
    h.update(f"{len(shards)}\n".encode())
    for shard in shards:
        # surrogatepass: names decoded from odd file systems may hold lone surrogates.
        name = shard.name.encode("utf-8", "surrogatepass")
        h.update(f"{len(name)}:".encode())
        h.update(name)
        h.update(f":{shard.num_samples}\n".encode())
    return h.hexdigest()


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch ``epoch`` visits shards ``0 .. num_shards - 1``.

    A permutation that depends only on ``(seed, epoch)``: shards are sorted by
    ``sha256("uc_checkpoint.data_tracker.order.v1:{seed}:{epoch}:{index}")``. This is used instead
    of ``random.Random(...).shuffle`` because Python only guarantees ``random()``'s sequence across
    versions, not how ``shuffle`` consumes it, and a resumed run must rebuild the very same order on
    any interpreter. Ties (never seen in practice) fall back to the shard index.
    """
    _check_int(num_shards, "num_shards", minimum=0)
    _check_int(seed, "seed")
    _check_int(epoch, "epoch", minimum=0)
    prefix = f"{_ORDER_TAG}:{seed}:{epoch}:"

    def key(index: int) -> tuple[bytes, int]:
        return hashlib.sha256(f"{prefix}{index}".encode()).digest(), index

    return sorted(range(num_shards), key=key)


def iter_positions(intervals: Iterable[Interval]) -> Iterator[tuple[int, int]]:
    """``(shard, sample)`` of every sample in ``intervals``, in order: what a reader yields."""
    for iv in intervals:
        for offset in range(iv.start, iv.end):
            yield iv.shard, offset


def _coalesce(intervals: Iterable[Interval]) -> list[Interval]:
    """Drop empty intervals and merge neighbours that continue each other in the same shard, so that
    the state stays one interval per contiguous run however the work was cut before."""
    out: list[Interval] = []
    for iv in intervals:
        if iv.size == 0:
            continue
        if out and out[-1].shard == iv.shard and out[-1].end == iv.start:
            out[-1] = Interval(iv.shard, out[-1].start, iv.end)
        else:
            out.append(iv)
    return out


def _drop_prefix(intervals: Sequence[Interval], count: int) -> list[Interval]:
    """``intervals`` without their first ``count`` samples."""
    out: list[Interval] = []
    for iv in intervals:
        if count >= iv.size:
            count -= iv.size
            continue
        out.append(Interval(iv.shard, iv.start + count, iv.end))
        count = 0
    return out


def slice_sizes(total: int, num_consumers: int, batch_size: int = 1) -> list[int]:
    """Sizes (in samples) of the slices :func:`assign` cuts ``total`` samples into.

    The work is counted in whole batches of ``batch_size`` samples plus ``partial = total %
    batch_size`` samples: with ``total // batch_size = q * num_consumers + r`` batches, the first
    ``r`` consumers get ``q + 1`` batches, the others ``q``, and the partial batch goes to consumer
    ``r`` (the first one with a batch fewer; consumer 0 when all have as many). So at most one
    consumer's slice is not a whole number of batches, and sizes differ by at most ``batch_size``.
    With ``batch_size=1`` that is: sizes differ by at most one sample, the first consumers getting
    the extra ones.

    Raises:
        TypeError, ValueError: an argument is not an int, or ``num_consumers``/``batch_size`` < 1.
    """
    _check_int(total, "total", minimum=0)
    _check_int(num_consumers, "num_consumers", minimum=1)
    _check_int(batch_size, "batch_size", minimum=1)
    batches, partial = divmod(total, batch_size)
    base, extra = divmod(batches, num_consumers)
    sizes = [(base + (1 if c < extra else 0)) * batch_size for c in range(num_consumers)]
    sizes[extra] += partial  # extra < num_consumers, so there is always such a consumer
    return sizes


def assign(remaining: Sequence[Interval], num_consumers: int, batch_size: int = 1) -> list[list[Interval]]:
    """Cut ``remaining`` (in stream order) into ``num_consumers`` contiguous slices.

    Consumer ``c`` gets the ``c``-th slice, of the size :func:`slice_sizes` gives: with the default
    ``batch_size=1`` sizes differ by at most one sample (with ``total = q * num_consumers + r`` the
    first ``r`` consumers get ``q + 1`` samples, the others ``q``); with a larger ``batch_size``
    every slice but at most one is a whole number of batches. A slice may start or end inside a
    shard and span several shards; slices are empty when there is too little work. Concatenating
    the slices gives back ``remaining`` (neighbouring pieces of one shard merged).
    """
    _check_int(num_consumers, "num_consumers", minimum=1)
    for iv in remaining:
        if not isinstance(iv, Interval):
            raise TypeError(f"assign() expects Interval items, got {type(iv).__name__}")
    work = _coalesce(remaining)
    sizes = slice_sizes(sum(iv.size for iv in work), num_consumers, batch_size)
    slices: list[list[Interval]] = []
    index = 0  # interval of `work` being cut
    cursor = work[0].start if work else 0  # first sample of work[index] not yet handed out
    for consumer in range(num_consumers):
        want = sizes[consumer]
        piece: list[Interval] = []
        while want > 0:
            iv = work[index]
            take = min(want, iv.end - cursor)
            piece.append(Interval(iv.shard, cursor, cursor + take))
            want -= take
            cursor += take
            if cursor == iv.end:
                index += 1
                if index < len(work):
                    cursor = work[index].start
        slices.append(piece)
    return slices


def _intervals_to_json(intervals: Iterable[Interval]) -> list[list[int]]:
    return [[iv.shard, iv.start, iv.end] for iv in intervals]


class DataTracker:
    """Exactly-once-per-epoch progress of one rank's data consumers, and the global checkpoint state.

    Args:
        shards: the dataset, in a fixed order that every rank and every run agrees on.
        seed: seed of the per-epoch shard order (:func:`epoch_shard_order`).
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks that split the data (the data-parallel degree; ranks that hold
            replicas of the same data, e.g. tensor-parallel peers, should share one data rank).
        num_workers: data-loader workers of this rank; 0 means the rank's main process reads the
            data (one consumer per rank).
        allow_dataset_change: on :meth:`load_global_state`, accept a state written for a different
            dataset (with a warning) instead of raising :class:`DatasetMismatchError`.
        batch_size: cut the work into whole batches of this many raw samples (see
            :func:`slice_sizes`): every consumer's slice but at most one, in the whole run, is a
            whole number of batches. Give the loader's batch size when the loader drops each
            worker's last partial batch (``drop_last=True``), so that an epoch drops the same
            ``total % batch_size`` samples however often it is resumed. Default 1: slices differ by
            at most one sample. Every rank must pass the same value (the merge checks it). The saved
            state does not depend on it.

    The tracker starts at epoch 0 with the whole epoch ahead. It is not thread-safe: call it from the
    training loop only.

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of range.
    """

    def __init__(
        self,
        shards: Sequence[ShardSpec],
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        allow_dataset_change: bool = False,
        batch_size: int = 1,
    ) -> None:
        shards = tuple(shards)
        if not shards:
            raise ValueError("DataTracker needs at least one shard")
        for shard in shards:
            if not isinstance(shard, ShardSpec):
                raise TypeError(f"shards must be ShardSpec items, got {type(shard).__name__}")
        _check_int(seed, "seed")
        _check_int(world_size, "world_size", minimum=1)
        _check_int(rank, "rank", minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
        _check_int(num_workers, "num_workers", minimum=0)
        _check_int(batch_size, "batch_size", minimum=1)
        self._batch_size = batch_size
        self._shards = shards
        self._fingerprint = dataset_fingerprint(shards)
        self._total_samples = sum(s.num_samples for s in shards)
        self._seed = seed
        self._rank = rank
        self._world_size = world_size
        self._num_workers = num_workers
        self._workers_per_rank = max(1, num_workers)
        self._allow_dataset_change = bool(allow_dataset_change)
        if self._total_samples == 0:
            logger.warning("data tracker: all %d shards are empty; every epoch is empty", len(shards))
        self._epoch = 0
        self._restored = False
        self._from_load = False  # the current work came from load_global_state
        self._generation = 0  # bumped by _set_work: lets a loader iterator notice its work was replaced
        self._load_count = 0
        self._set_work(0, self._whole_epoch(0))

    # ------------------------------------------------------------------ properties

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def seed(self) -> int:
        """Seed of the shard order (the checkpoint's seed after :meth:`load_global_state`)."""
        return self._seed

    @property
    def shards(self) -> tuple[ShardSpec, ...]:
        return self._shards

    @property
    def fingerprint(self) -> str:
        """:func:`dataset_fingerprint` of :attr:`shards`."""
        return self._fingerprint

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def workers_per_rank(self) -> int:
        """Consumers per rank: ``max(1, num_workers)``."""
        return self._workers_per_rank

    @property
    def batch_size(self) -> int:
        """Raw samples per batch the work is cut in (see the constructor); 1 by default."""
        return self._batch_size

    @property
    def num_consumers(self) -> int:
        """Consumers across all ranks: ``world_size * workers_per_rank``."""
        return self._world_size * self._workers_per_rank

    @property
    def total_samples(self) -> int:
        """Samples in one epoch (all shards)."""
        return self._total_samples

    @property
    def assignment_id(self) -> str:
        """Short id (16 hex digits) of the current work split: the dataset, epoch, remaining work and
        number of consumers. It changes at every :meth:`start_epoch` and :meth:`load_global_state`
        that changes the work."""
        return self._assignment

    @property
    def generation(self) -> int:
        """Counts replacements of the work: the constructor sets it, and every :meth:`start_epoch`
        that starts an epoch and every :meth:`load_global_state` adds one, even when the new work is
        the same as the old (a reload of the same state resets progress all the same). A
        :meth:`start_epoch` that keeps the restored work changes nothing and leaves it alone. A
        data-loader iterator remembers it to notice that the work it reads was replaced."""
        return self._generation

    @property
    def load_count(self) -> int:
        """How many times :meth:`load_global_state` has succeeded on this tracker. Persistent
        data-loader workers hold a copy made before a load and cannot follow it; the loader compares
        this count to restart them."""
        return self._load_count

    @property
    def work_from_checkpoint(self) -> bool:
        """True while the current work came from :meth:`load_global_state` rather than from
        :meth:`start_epoch` (which a data-loader worker can recompute from ``(seed, epoch)`` alone)."""
        return self._from_load

    def consumer_id(self, worker: int) -> int:
        """Global number of this rank's consumer ``worker``: ``rank * workers_per_rank + worker``."""
        _check_int(worker, "worker", minimum=0)
        if worker >= self._workers_per_rank:
            raise ValueError(
                f"worker {worker} is out of range: this tracker has {self._workers_per_rank} consumer(s) "
                f"per rank (num_workers={self._num_workers}; 0 means the main process is worker 0)"
            )
        return self._rank * self._workers_per_rank + worker

    # ------------------------------------------------------------------ epochs

    def _whole_epoch(self, epoch: int) -> list[Interval]:
        order = epoch_shard_order(len(self._shards), self._seed, epoch)
        return [Interval(i, 0, self._shards[i].num_samples) for i in order if self._shards[i].num_samples]

    def _set_work(self, epoch: int, remaining: list[Interval]) -> None:
        """Make ``remaining`` the work of ``epoch`` and cut it for this run's consumers."""
        self._epoch = epoch
        self._base = _coalesce(remaining)
        self._slices = assign(self._base, self.num_consumers, self._batch_size)
        self._slice_sizes = [sum(iv.size for iv in s) for s in self._slices]
        self._consumed = [0] * self._workers_per_rank
        self._generation += 1
        # Identifies this assignment so global_state() can reject local states taken from another one
        # (a rank that started a different epoch, loaded a different checkpoint or cuts in other
        # batch sizes).
        h = hashlib.sha256(_ASSIGNMENT_TAG)
        h.update(f"{self._fingerprint}:{epoch}:{self.num_consumers}:{self._batch_size}:".encode())
        for iv in self._base:
            h.update(f"{iv.shard},{iv.start},{iv.end};".encode())
        self._assignment = h.hexdigest()[:16]

    def start_epoch(self, epoch: int) -> None:
        """Begin ``epoch``: the remaining work becomes the whole dataset in that epoch's shard order.

        Exception: the first call after :meth:`load_global_state` that names the restored epoch keeps
        the restored remaining work, so that a loop calling ``start_epoch(epoch)`` for every epoch
        resumes instead of replaying the epoch. A warning is logged when work this rank had not yet
        consumed is abandoned.
        """
        _check_int(epoch, "epoch", minimum=0)
        restored, self._restored = self._restored, False
        if restored and epoch == self._epoch:
            logger.info(
                "data tracker: continuing restored epoch %d (%d samples left for rank %d)",
                epoch,
                self.samples_left(),
                self._rank,
            )
            return
        left = self.samples_left()
        # Abandoning an untouched fresh epoch (e.g. the constructor's epoch 0 before start_epoch(5))
        # loses nothing; abandoning restored or partly consumed work is worth a warning.
        if left and (self._from_load or any(self._consumed)):
            logger.warning(
                "data tracker: rank %d starts epoch %d leaving %d samples of epoch %d unread",
                self._rank,
                epoch,
                left,
                self._epoch,
            )
        self._set_work(epoch, self._whole_epoch(epoch))
        self._from_load = False
        logger.debug("data tracker: rank %d started epoch %d", self._rank, epoch)

    # ------------------------------------------------------------------ consumers

    def consumer_slices(self, worker: int) -> list[Interval]:
        """The samples this rank's consumer ``worker`` still has to read, in order.

        Its slice of the current assignment minus the prefix already recorded as consumed: after a
        resume this excludes everything consumed before the checkpoint; in the same run it lets a
        re-created loader iterator continue where consumption stopped.
        """
        c = self.consumer_id(worker)
        return _drop_prefix(self._slices[c], self._consumed[worker])

    def record(self, worker: int, count: int = 1) -> None:
        """Record that this rank's consumer ``worker`` consumed its next ``count`` raw samples.

        Raises:
            ValueError: ``count`` is negative or more than the consumer has left (it read past its
                slice, which would break exactly-once).
        """
        c = self.consumer_id(worker)
        _check_int(count, "count", minimum=0)
        left = self._slice_sizes[c] - self._consumed[worker]
        if count > left:
            raise ValueError(
                f"record(worker={worker}, count={count}) on rank {self._rank}: only {left} samples of "
                f"its slice are left in epoch {self._epoch}"
            )
        self._consumed[worker] += count

    def position(self, worker: int) -> tuple[int, int] | None:
        """``(shard, offset)`` of the next sample consumer ``worker`` will consume, or None when its
        slice is used up."""
        rest = self.consumer_slices(worker)
        return (rest[0].shard, rest[0].start) if rest else None

    def samples_consumed(self, worker: int) -> int:
        """Samples of its current slice this rank's consumer ``worker`` has consumed."""
        self.consumer_id(worker)
        return self._consumed[worker]

    def samples_left(self, worker: int | None = None) -> int:
        """Samples consumer ``worker`` (default: all of this rank's consumers) has not consumed yet."""
        workers = range(self._workers_per_rank) if worker is None else [worker]
        return sum(self._slice_sizes[self.consumer_id(w)] - self._consumed[w] for w in workers)

    def rank_exhausted(self) -> bool:
        """True when every consumer of this rank has consumed its whole slice (other ranks may still
        have a few samples; see "Uneven ends" in the module docs)."""
        return self.samples_left() == 0

    def follow(self, epoch: int, assignment_id: str, consumed: Sequence[int]) -> bool:
        """Bring a copy of the tracker that lives in a data-loader worker to the main process's state.

        ``epoch``, ``assignment_id`` and ``consumed`` (one count per worker) come from the main
        process's tracker. A copy can follow a new epoch on its own (the work is a function of
        ``(seed, epoch)``); it cannot follow a :meth:`load_global_state` made after it was copied.
        Returns False in that case (the worker must be restarted with a fresh copy), True otherwise.
        """
        if assignment_id != self._assignment:
            self._set_work(epoch, self._whole_epoch(epoch))
            self._from_load = False
            self._restored = False
            if assignment_id != self._assignment:
                return False
        if len(consumed) != self._workers_per_rank:
            raise ValueError(f"follow() got {len(consumed)} consumed counts for {self._workers_per_rank} workers")
        for w, k in enumerate(consumed):
            self._consumed[w] = _check_int(int(k), f"worker {w} consumed", minimum=0)
        return True

    def resume_summary(self, max_names: int = 8) -> dict[str, Any]:
        """What a run resumed from this tracker's current work skips and where it seeks: for logs.

        Returns ``{"epoch", "samples_consumed_in_epoch", "samples_remaining", "skipped_shards" (count of
        shards with no work left in the epoch), "skipped_names" (at most ``max_names`` of them),
        "partial_shards" ([name, samples already consumed, shard size] of shards with work left that
        was partly consumed), "seeks" ([rank, worker, shard name, offset] of every consumer whose next
        sample is not at the start of a shard)}``.
        """
        left_per_shard = [0] * len(self._shards)
        for iv in self._base:
            left_per_shard[iv.shard] += iv.size
        skipped = [s.name for i, s in enumerate(self._shards) if s.num_samples and left_per_shard[i] == 0]
        partial = [
            [s.name, s.num_samples - left_per_shard[i], s.num_samples]
            for i, s in enumerate(self._shards)
            if 0 < left_per_shard[i] < s.num_samples
        ]
        seeks = []
        for c, piece in enumerate(self._slices):
            if piece and piece[0].start > 0:
                rank, worker = divmod(c, self._workers_per_rank)
                seeks.append([rank, worker, self._shards[piece[0].shard].name, piece[0].start])
        remaining = sum(left_per_shard)
        return {
            "epoch": self._epoch,
            "samples_consumed_in_epoch": self._total_samples - remaining,
            "samples_remaining": remaining,
            "skipped_shards": len(skipped),
            "skipped_names": skipped[:max_names],
            "partial_shards": partial,
            "seeks": seeks,
        }

    # ------------------------------------------------------------------ state

    def local_state(self) -> dict[str, Any]:
        """This rank's progress, to be gathered from all ranks for :meth:`global_state`.

        ``{"rank": int, "consumed": [samples consumed per worker], "epoch": int, "assignment": str}``;
        ``epoch`` and ``assignment`` (a short id of the current work split) let the merge check that
        all ranks describe the same assignment.
        """
        return {
            "rank": self._rank,
            "consumed": list(self._consumed),
            "epoch": self._epoch,
            "assignment": self._assignment,
        }

    def _gather(self, local_states: Sequence[dict[str, Any]]) -> list[int]:
        """Validated consumed counts of all consumers, in consumer order.

        Raises:
            TrackerStateError: a local state is malformed, missing, doubled, or describes another
                epoch or assignment than this rank's.
        """
        if len(local_states) != self._world_size:
            raise TrackerStateError(
                f"global_state() needs the local state of all {self._world_size} ranks, got {len(local_states)}"
            )
        per_rank: dict[int, list[int]] = {}
        for st in local_states:
            if not isinstance(st, dict) or not {"rank", "consumed", "epoch", "assignment"} <= st.keys():
                raise TrackerStateError(f"not a DataTracker.local_state(): {st!r}")
            r = _state_int(st["rank"], "local state rank", minimum=0)
            if r >= self._world_size:
                raise TrackerStateError(f"local state of rank {r} but world_size is {self._world_size}")
            if r in per_rank:
                raise TrackerStateError(f"two local states for rank {r}")
            if st["epoch"] != self._epoch or st["assignment"] != self._assignment:
                raise TrackerStateError(
                    f"rank {r}'s local state is from epoch {st['epoch']} / assignment {st['assignment']}, "
                    f"this rank is at epoch {self._epoch} / assignment {self._assignment}: every rank must "
                    "call start_epoch/load_global_state alike (and build its tracker with the same "
                    "num_workers and batch_size) before the states are gathered"
                )
            consumed = st["consumed"]
            if not isinstance(consumed, list) or len(consumed) != self._workers_per_rank:
                raise TrackerStateError(
                    f"rank {r}'s local state has {consumed!r} as consumed counts, expected "
                    f"{self._workers_per_rank} ints (one per worker)"
                )
            for w, k in enumerate(consumed):
                size = self._slice_sizes[r * self._workers_per_rank + w]
                _state_int(k, f"rank {r} worker {w} consumed", minimum=0)
                if k > size:
                    raise TrackerStateError(f"rank {r} worker {w} consumed {k} samples of a {size}-sample slice")
            per_rank[r] = consumed
        return [k for r in range(self._world_size) for k in per_rank[r]]

    def global_state(
        self, local_states: Sequence[dict[str, Any]], *, include_shard_list: bool = True
    ) -> dict[str, Any]:
        """The checkpointable data state, from the :meth:`local_state` of every rank.

        Every rank computes the same dict from the same gathered list. Keys:

        * ``format``: :data:`STATE_FORMAT`.
        * ``fingerprint``: :func:`dataset_fingerprint` of the dataset.
        * ``seed``, ``epoch``: the shard-order seed and the current epoch.
        * ``remaining``: ``[[shard, start, end], ...]`` in stream order, the samples of this epoch not
          consumed yet (empty: the epoch is finished).
        * ``samples_consumed_in_epoch``: samples of the epoch no longer to be read.
        * ``num_shards``: number of shards of the dataset.
        * ``shards`` (when ``include_shard_list``): ``[[name, num_samples], ...]``, so that a load on a
          changed dataset can name the shard that differs and map the remaining work by shard name. It
          costs about ``len(name) + 10`` bytes per shard; turn it off for very many shards.

        All values are plain ints, strings and lists (JSON-serialisable).

        Raises:
            TrackerStateError: a gathered local state is malformed or from another assignment.
        """
        consumed = self._gather(local_states)
        remaining = _coalesce(iv for c, piece in enumerate(self._slices) for iv in _drop_prefix(piece, consumed[c]))
        left = sum(iv.size for iv in remaining)
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "fingerprint": self._fingerprint,
            "seed": self._seed,
            "epoch": self._epoch,
            "remaining": _intervals_to_json(remaining),
            "samples_consumed_in_epoch": self._total_samples - left,
            "num_shards": len(self._shards),
        }
        if include_shard_list:
            state["shards"] = [[s.name, s.num_samples] for s in self._shards]
        return state

    def epoch_done(self, local_states: Sequence[dict[str, Any]] | None = None) -> bool:
        """True when no rank has work left in the current epoch (the global remaining work is empty).

        Pass the gathered :meth:`local_state` of all ranks; with ``world_size == 1`` they may be
        omitted. (From one rank alone only :meth:`rank_exhausted` can be known.)

        Raises:
            ValueError: no local states given while ``world_size > 1``.
            TrackerStateError: a gathered local state is malformed or from another assignment.
        """
        if local_states is None:
            if self._world_size != 1:
                raise ValueError(
                    "epoch_done() needs the gathered local states of all ranks when world_size > 1 "
                    "(use rank_exhausted() for this rank alone)"
                )
            local_states = [self.local_state()]
        consumed = self._gather(local_states)
        return all(k == size for k, size in zip(consumed, self._slice_sizes))

    def load_global_state(self, state: dict[str, Any]) -> None:
        """Restore the epoch and remaining work from :meth:`global_state` (of this or any other
        topology) and cut the remaining work for this tracker's rank, world size and workers.

        The checkpoint's seed replaces the tracker's (a warning says so when they differ) so that later
        epochs follow the saved run's order. Every load replaces the work, even a reload of the state
        the tracker already holds: :attr:`generation` goes up, so that a data-loader iterator created
        before the load refuses to go on (it would read the old work) instead of drifting from what
        the tracker records. Nothing changes when the state is refused.

        Raises:
            DatasetMismatchError: the state was written for a different dataset and
                ``allow_dataset_change`` is False. With it True, a warning is logged and the remaining
                work is kept where it still fits: intervals of shards that are gone are dropped, those
                of shrunk shards clipped (matched by shard name when the state has the shard list, else
                by index). Shards or samples added since are read from the next epoch on.
            TrackerStateError: (a ``ValueError``) the state is not a dict, has another ``format``, a
                missing or unknown key, a field of the wrong type or out of range, remaining work that
                overlaps, is out of stream order or exceeds its shard, or counts that do not add up to
                the dataset. The message names the field.
        """
        if not isinstance(state, dict):
            raise TrackerStateError(f"data tracker state must be a dict, got {type(state).__name__}")
        fmt = state.get("format")
        if type(fmt) is not int or fmt != STATE_FORMAT:  # not True or 1.0, which compare equal to 1
            raise TrackerStateError(
                f"unsupported data tracker state format {fmt!r}: this version reads format {STATE_FORMAT}"
            )
        missing = _STATE_KEYS - state.keys()
        if missing:
            raise TrackerStateError(f"data tracker state lacks {sorted(missing)}")
        # A key this format does not define means the state was written (or edited) by something
        # else; ignoring it could silently drop what it meant.
        unknown = state.keys() - _STATE_KEYS - {"shards"}
        if unknown:
            raise TrackerStateError(
                f"data tracker state has unknown keys {sorted(map(repr, unknown))}: format {STATE_FORMAT} "
                f"has {sorted(_STATE_KEYS | {'shards'})}"
            )
        epoch = _state_int(state["epoch"], "epoch", minimum=0)
        seed = _state_int(state["seed"], "seed")
        saved_num_shards = _state_int(state["num_shards"], "num_shards", minimum=0)
        consumed = _state_int(state["samples_consumed_in_epoch"], "samples_consumed_in_epoch", minimum=0)
        fingerprint = state["fingerprint"]
        if not isinstance(fingerprint, str):
            raise TrackerStateError(
                f"data tracker state: fingerprint must be a str, got {type(fingerprint).__name__} {fingerprint!r}"
            )
        saved_shards = self._parse_shard_list(state.get("shards"), saved_num_shards)
        remaining = self._parse_remaining(state["remaining"], saved_num_shards, saved_shards)

        if fingerprint == self._fingerprint:
            # Same dataset: the state's own description of it must agree, or the state is corrupt.
            if saved_num_shards != len(self._shards):
                raise TrackerStateError(
                    f"data tracker state is corrupt: num_shards is {saved_num_shards} but its fingerprint "
                    f"is that of this dataset of {len(self._shards)} shards"
                )
            if saved_shards is not None and saved_shards != [(sh.name, sh.num_samples) for sh in self._shards]:
                raise TrackerStateError(
                    "data tracker state is corrupt: its shards list disagrees with its fingerprint, which "
                    "is that of this dataset"
                )
            for iv in remaining:
                if iv.end > self._shards[iv.shard].num_samples:
                    raise TrackerStateError(
                        f"data tracker state is corrupt: remaining interval {iv} exceeds shard "
                        f"{self._shards[iv.shard].name!r} ({self._shards[iv.shard].num_samples} samples)"
                    )
            left = sum(iv.size for iv in remaining)
            if consumed + left != self._total_samples:
                raise TrackerStateError(
                    f"data tracker state is inconsistent: samples_consumed_in_epoch {consumed} + {left} "
                    f"remaining samples != {self._total_samples} samples in the dataset"
                )
        else:
            diff = self._describe_difference(fingerprint, saved_num_shards, saved_shards)
            if not self._allow_dataset_change:
                raise DatasetMismatchError(
                    f"the data state was saved for a different dataset: {diff}. Pass "
                    "allow_dataset_change=True to continue with the remaining work that still fits."
                )
            remaining, dropped = self._remap(remaining, saved_shards)
            logger.warning(
                "data tracker: dataset changed since the checkpoint (%s); continuing epoch %d with the "
                "saved remaining work: %d samples dropped (shards removed or shrunk), %d kept; shards and "
                "samples added since are read from the next epoch on",
                diff,
                epoch,
                dropped,
                sum(iv.size for iv in remaining),
            )

        if seed != self._seed:
            logger.warning(
                "data tracker: the checkpoint's shard-order seed %d replaces the configured seed %d",
                seed,
                self._seed,
            )
            self._seed = seed
        self._set_work(epoch, remaining)
        self._restored = True
        self._from_load = True
        self._load_count += 1
        logger.info(
            "data tracker: rank %d restored epoch %d, %d samples remaining, split over %d consumers (%d for this rank)",
            self._rank,
            epoch,
            sum(iv.size for iv in self._base),
            self.num_consumers,
            self.samples_left(),
        )

    # ------------------------------------------------------------------ loading helpers

    @staticmethod
    def _parse_shard_list(raw: Any, num_shards: int) -> list[tuple[str, int]] | None:
        if raw is None:
            return None
        if not isinstance(raw, list) or len(raw) != num_shards:
            raise TrackerStateError(
                f"data tracker state: 'shards' must list num_shards={num_shards} [name, num_samples] pairs, "
                f"got {type(raw).__name__}{f' of {len(raw)}' if isinstance(raw, list) else ''}"
            )
        out: list[tuple[str, int]] = []
        for i, item in enumerate(raw):
            if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
                raise TrackerStateError(f"data tracker state: shards[{i}] is {item!r}, not [name, num_samples]")
            out.append((item[0], _state_int(item[1], f"shards[{i}] ({item[0]!r}) num_samples", minimum=0)))
        return out

    @staticmethod
    def _parse_remaining(raw: Any, num_shards: int, saved_shards: list[tuple[str, int]] | None) -> list[Interval]:
        if not isinstance(raw, list):
            raise TrackerStateError(
                f"data tracker state: 'remaining' must be a list of [shard, start, end], got {type(raw).__name__}"
            )
        out: list[Interval] = []
        done: set[int] = set()  # shards whose pieces are behind us in the list
        for i, item in enumerate(raw):
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise TrackerStateError(f"data tracker state: bad remaining interval remaining[{i}] = {item!r}")
            shard, start, end = (
                _state_int(v, f"remaining[{i}] {name}", minimum=0) for v, name in zip(item, ("shard", "start", "end"))
            )
            if end < start:
                raise TrackerStateError(
                    f"data tracker state: bad remaining interval remaining[{i}] = {item!r}: end < start"
                )
            if shard >= num_shards:
                raise TrackerStateError(
                    f"data tracker state: remaining[{i}] = {item!r} names shard {shard} of {num_shards}"
                )
            if saved_shards is not None and end > saved_shards[shard][1]:
                raise TrackerStateError(
                    f"data tracker state: remaining[{i}] = {item!r} exceeds its shard "
                    f"{saved_shards[shard][0]!r} ({saved_shards[shard][1]} samples)"
                )
            iv = Interval(shard, start, end)
            # Stream order reads a shard in one go, ascending: its pieces are neighbours in the list and
            # ascending. Anything else is not a state global_state() wrote, and overlapping pieces
            # would have a sample read twice.
            if out and out[-1].shard == shard:
                if start < out[-1].end:
                    raise TrackerStateError(
                        f"data tracker state: remaining intervals {out[-1]} and {iv} (remaining[{i}]) overlap "
                        "or are out of order"
                    )
            else:
                if shard in done:
                    raise TrackerStateError(
                        f"data tracker state: remaining[{i}] = {item!r} returns to shard {shard} after other "
                        "shards: remaining work must be in stream order (each shard's pieces together, "
                        "ascending)"
                    )
                if out:
                    done.add(out[-1].shard)
            out.append(iv)
        return out

    def _describe_difference(
        self, saved_fingerprint: Any, saved_num_shards: int, saved_shards: list[tuple[str, int]] | None
    ) -> str:
        now = len(self._shards)
        parts = []
        if saved_num_shards != now:
            parts.append(f"number of shards: checkpoint {saved_num_shards}, now {now}")
        if saved_shards is not None:
            current = [(s.name, s.num_samples) for s in self._shards]
            for i in range(max(len(saved_shards), len(current))):
                old = saved_shards[i] if i < len(saved_shards) else None
                new = current[i] if i < len(current) else None
                if old != new:

                    def show(entry: tuple[str, int] | None) -> str:
                        return "no shard" if entry is None else f"{entry[0]!r} ({entry[1]} samples)"

                    parts.append(f"first difference at shard {i}: checkpoint had {show(old)}, now {show(new)}")
                    break
        elif saved_num_shards == now:
            parts.append(
                f"same number of shards ({now}) but different names, sizes or order (the state has no "
                "shard list to say which)"
            )
        parts.append(f"fingerprint {str(saved_fingerprint)[:12]}... vs {self._fingerprint[:12]}...")
        return "; ".join(parts)

    def _remap(
        self, remaining: list[Interval], saved_shards: list[tuple[str, int]] | None
    ) -> tuple[list[Interval], int]:
        """Remaining work translated to the current shards; returns it and the samples dropped."""
        if saved_shards is not None:
            # Match by (name, occurrence) so that a dataset listing a shard twice maps each copy once.
            index_of: dict[tuple[str, int], int] = {}
            seen: dict[str, int] = {}
            for i, s in enumerate(self._shards):
                index_of[(s.name, seen.get(s.name, 0))] = i
                seen[s.name] = seen.get(s.name, 0) + 1
            saved_key: list[tuple[str, int]] = []
            seen.clear()
            for name, _ in saved_shards:
                saved_key.append((name, seen.get(name, 0)))
                seen[name] = seen.get(name, 0) + 1
            target = [index_of.get(k) for k in saved_key]
        else:
            target = [
                i if i < len(self._shards) else None for i in range(max((iv.shard for iv in remaining), default=-1) + 1)
            ]
        kept: list[Interval] = []
        dropped = 0
        for iv in remaining:
            new = target[iv.shard]
            if new is None:
                dropped += iv.size
                continue
            end = min(iv.end, self._shards[new].num_samples)
            if end <= iv.start:
                dropped += iv.size
                continue
            dropped += iv.end - end
            kept.append(Interval(new, iv.start, end))
        return kept, dropped


__all__ = [
    "STATE_FORMAT",
    "DataTracker",
    "DatasetMismatchError",
    "Interval",
    "ShardSpec",
    "TrackerStateError",
    "assign",
    "dataset_fingerprint",
    "epoch_shard_order",
    "iter_positions",
    "slice_sizes",
]
