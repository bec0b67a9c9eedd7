"""Which data samples a training run has consumed: exactly once per epoch, across restarts that
change the number of ranks or data-loader workers.

:class:`DataTracker` (one per rank, in the training process) holds the epoch's remaining work, a list
of :class:`Interval` of raw samples in the epoch's shard order (:func:`epoch_shard_order`), cut into
one contiguous slice per consumer (every data-loader worker of every rank, numbered
``rank * workers_per_rank + worker``), and how many samples of its slice each of this rank's
consumers has consumed. :meth:`DataTracker.global_state` turns the gathered progress of all ranks
into a state that names no rank or worker but in its optional per-consumer cut
(:mod:`uc_checkpoint.data.layout`); :meth:`DataTracker.load_global_state` cuts that remaining work
afresh for any world size and number of workers, or as saved on the same topology, so that a resume
there is exact batch for batch. :class:`TrackerConfig` holds the settings.

The model, its semantics (uneven ends, resumes, persistent workers, ``drop_last``) and how to wire
it into a training loop: ``docs/data-tracker.md``. The arithmetic on intervals is in
:mod:`uc_checkpoint.data.intervals`, the saved state's format and checks in
:mod:`uc_checkpoint.data.state`, the DataLoader and DCP wiring in :mod:`uc_checkpoint.data.loading`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from uc_checkpoint.data.config import TrackerConfig
from uc_checkpoint.data.dataset_change import DatasetChange, carry_over_state
from uc_checkpoint.data.digest import EpochLedger, SampleDigest, ShardHasher, check_digest, enforce
from uc_checkpoint.data.intervals import (
    Interval,
    ShardSpec,
    assign,
    assignment_id,
    check_int,
    coalesce,
    cut,
    dataset_fingerprint,
    drop_prefix,
    epoch_shard_order,
    iter_positions,
    resume_summary,
    slice_sizes,
    total_size,
    whole_epoch,
)
from uc_checkpoint.data.layout import ConsumerLayout, gathered_next_workers, usable_layout
from uc_checkpoint.data.shuffle import ShardPermutation
from uc_checkpoint.data.state import STATE_FORMAT, TrackerState, merge_local_states
from uc_checkpoint.errors import DatasetMismatchError, TrackerStateError

logger = logging.getLogger(__name__)


class _Source(enum.Enum):
    """Where the current work came from."""

    EPOCH = "epoch"  # the constructor, start_epoch or a worker's sync: a function of (seed, epoch)
    LOADED = "loaded"  # load_global_state, no start_epoch since: start_epoch(its epoch) continues it
    CONTINUED = "continued"  # loaded work that start_epoch continued


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
        allow_dataset_change: on :meth:`load_global_state`, carry a state written for a different
            dataset over to this one (shard by shard name, with a warning) instead of raising
            :class:`DatasetMismatchError`; unread samples it cannot carry over still raise it, naming
            their shards, unless ``drop_unmapped``.
        drop_unmapped: with ``allow_dataset_change``, drop the unread samples that cannot be carried
            over instead of raising; :attr:`dataset_change` then lists them.
        batch_size: cut the work into whole batches of this many raw samples (see
            :func:`slice_sizes`): every consumer's slice but at most one, in the whole run, is a
            whole number of batches. Give the loader's batch size when the loader drops each
            worker's last partial batch (``drop_last=True``), so that an epoch drops the same
            ``total % batch_size`` samples however often it is resumed. Default 1: slices differ by
            at most one sample. Every rank must pass the same value (the merge checks it). The saved
            state does not depend on it.
        shuffle_within_shard: read each shard's samples in a keyed permutation of its own per
            ``(seed, epoch, shard)`` (:class:`~uc_checkpoint.data.shuffle.ShardPermutation`) instead of
            in order. The intervals stay positions in the shard's reading order;
            :meth:`sample_indices` maps them to sample indices, and the reader must be random-access
            (``read_indices``). A checkpoint's setting replaces this one on load, like the seed.
        exactly_once: the end-of-epoch check that every sample of the epoch was consumed exactly
            once (an order-independent digest of the sample identities consumed, carried across
            workers, ranks and resumes): ``"raise"`` (default) raises
            :class:`~uc_checkpoint.errors.ExactlyOnceError`, ``"warn"`` logs a warning, ``"off"``
            neither computes nor checks it. See "Exactly-once" in ``docs/data-tracker.md``.

    The tracker starts at epoch 0 with the whole epoch ahead. It is not thread-safe: call it from the
    training loop only. Settings: :attr:`config` (``tracker.config.rank``, ``.world_size``,
    ``.workers_per_rank``, ``.seed``, ``.shards``, ``.batch_size``, ...).

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
        shuffle_within_shard: bool = False,
        exactly_once: str = "raise",
        drop_unmapped: bool = False,
    ) -> None:
        config = TrackerConfig(
            tuple(shards),
            seed,
            rank,
            world_size,
            num_workers,
            allow_dataset_change,
            batch_size,
            shuffle_within_shard,
            exactly_once,
            drop_unmapped,
        )
        self._init(config)

    @classmethod
    def from_config(cls, config: TrackerConfig) -> DataTracker:
        """A tracker with the settings ``config`` holds (the same as passing them one by one)."""
        tracker = cls.__new__(cls)
        tracker._init(config)
        return tracker

    def _init(self, config: TrackerConfig) -> None:
        self._config = config
        if config.total_samples == 0:
            logger.warning("data tracker: all %d shards are empty; every epoch is empty", len(config.shards))
        self._source = _Source.EPOCH
        self._generation = 0  # bumped by _set_work: lets a loader iterator notice its work was replaced
        self._load_count = 0
        self._dataset_change: DatasetChange | None = None
        self._hasher = ShardHasher([s.name for s in config.shards])
        self._set_work(0, whole_epoch(config.shards, config.seed, 0), SampleDigest())

    # ------------------------------------------------------------------ properties

    @property
    def config(self) -> TrackerConfig:
        """The tracker's settings (with the checkpoint's seed after :meth:`load_global_state`)."""
        return self._config

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

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
    def dataset_change(self) -> DatasetChange | None:
        """What the last :meth:`load_global_state` did to carry a state of a changed dataset over
        (``allow_dataset_change``): the unread samples carried, those dropped per shard
        (``drop_unmapped``), shards whose content changed and shards added. None when the last load
        was of this very dataset, or before any load."""
        return self._dataset_change

    @property
    def next_worker(self) -> int:
        """The worker of this rank whose batch comes next in a DataLoader's turn (worker 0, 1, ...,
        0, ...): the one after the worker :meth:`record` last counted, 0 for fresh work, or the
        saved one after a load of this topology (:mod:`uc_checkpoint.data.layout`).
        :class:`~uc_checkpoint.data.loading.TrackedDataLoader` starts each new iterator's turn there."""
        return self._next_worker

    @property
    def work_from_checkpoint(self) -> bool:
        """True while the current work came from :meth:`load_global_state` rather than from
        :meth:`start_epoch` (which a data-loader worker can recompute from ``(seed, epoch)`` alone)."""
        return self._source is not _Source.EPOCH

    def consumer_id(self, worker: int) -> int:
        """Global number of this rank's consumer ``worker``: ``rank * workers_per_rank + worker``."""
        check_int(worker, "worker", minimum=0)
        per_rank = self._config.workers_per_rank
        if worker >= per_rank:
            raise ValueError(
                f"worker {worker} is out of range: this tracker has {per_rank} consumer(s) "
                f"per rank (num_workers={self._config.num_workers}; 0 means the main process is worker 0)"
            )
        return self._config.rank * per_rank + worker

    # ------------------------------------------------------------------ epochs

    def _set_work(
        self,
        epoch: int,
        remaining: list[Interval],
        consumed_before: SampleDigest | None,
        layout: ConsumerLayout | None = None,
    ) -> None:
        """Make ``remaining`` the work of ``epoch`` and cut it for this run's consumers (evenly, or as
        a saved ``layout`` of this topology says); ``consumed_before`` is the digest of what the epoch
        consumed before (None: unknown, the epoch cannot be checked; an empty digest for a fresh
        epoch)."""
        cfg = self._config
        self._epoch = epoch
        self._base = coalesce(remaining)
        if layout is None:
            self._slices = assign(self._base, cfg.num_consumers, cfg.batch_size)
            self._next_worker = 0
        else:
            self._slices = cut(self._base, layout.remaining)
            self._next_worker = layout.next_worker[cfg.rank]
        self._slice_sizes = [total_size(s) for s in self._slices]
        self._consumed = [0] * cfg.workers_per_rank
        self._generation += 1
        self._assignment = assignment_id(
            cfg.fingerprint,
            epoch,
            cfg.num_consumers,
            cfg.batch_size,
            self._base,
            cfg.shuffle_within_shard,
            None if layout is None else layout.remaining,
        )
        self._ledger = EpochLedger(cfg.workers_per_rank, consumed_before)

    def start_epoch(self, epoch: int) -> None:
        """Begin ``epoch``: the remaining work becomes the whole dataset in that epoch's shard order.

        Exception: the first call after :meth:`load_global_state` that names the restored epoch keeps
        the restored remaining work, so that a loop calling ``start_epoch(epoch)`` for every epoch
        resumes instead of replaying the epoch. A warning is logged when work this rank had not yet
        consumed is abandoned.
        """
        check_int(epoch, "epoch", minimum=0)
        if self._source is _Source.LOADED and epoch == self._epoch:
            self._source = _Source.CONTINUED
            logger.info(
                "data tracker: continuing restored epoch %d (%d samples left for rank %d)",
                epoch,
                self.samples_left(),
                self._config.rank,
            )
            return
        left = self.samples_left()
        # Abandoning an untouched fresh epoch (e.g. the constructor's epoch 0 before start_epoch(5))
        # loses nothing; abandoning restored or partly consumed work is worth a warning.
        if left and (self.work_from_checkpoint or any(self._consumed)):
            logger.warning(
                "data tracker: rank %d starts epoch %d leaving %d samples of epoch %d unread",
                self._config.rank,
                epoch,
                left,
                self._epoch,
            )
        if self._config.world_size == 1 and not left:
            self.epoch_done()  # the one rank knows the whole epoch: check it (once) before leaving it
        self._set_work(epoch, whole_epoch(self._config.shards, self._config.seed, epoch), SampleDigest())
        self._source = _Source.EPOCH
        logger.debug("data tracker: rank %d started epoch %d", self._config.rank, epoch)

    # ------------------------------------------------------------------ consumers

    def consumer_slices(self, worker: int) -> list[Interval]:
        """The samples this rank's consumer ``worker`` still has to read, in order.

        Its slice of the current assignment minus the prefix already recorded as consumed: after a
        resume this excludes everything consumed before the checkpoint; in the same run it lets a
        re-created loader iterator continue where consumption stopped.
        """
        return drop_prefix(self._slices[self.consumer_id(worker)], self._consumed[worker])

    def record(self, worker: int, count: int = 1, digest: SampleDigest | None = None) -> None:
        """Record that this rank's consumer ``worker`` consumed its next ``count`` raw samples.

        ``digest`` is the :class:`~uc_checkpoint.data.digest.SampleDigest` of the samples the worker
        actually read for them (what :class:`~uc_checkpoint.data.loading.TrackedDataLoader` passes);
        without it the tracker counts the samples its slice says come next.

        Raises:
            ValueError: ``count`` is negative or more than the consumer has left (it read past its
                slice, which would break exactly-once), or ``digest`` counts another number of samples.
        """
        c = self.consumer_id(worker)
        check_int(count, "count", minimum=0)
        left = self._slice_sizes[c] - self._consumed[worker]
        if count > left:
            raise ValueError(
                f"record(worker={worker}, count={count}) on rank {self._config.rank}: only {left} samples of "
                f"its slice are left in epoch {self._epoch}"
            )
        if self._config.exactly_once != "off":
            self._ledger.add(worker, self._consumed[worker], count, digest)
        self._consumed[worker] += count
        self._next_worker = (worker + 1) % self._config.workers_per_rank

    def sample_indices(self, interval: Interval) -> np.ndarray:
        """The sample indices (``int64`` array) that the positions of ``interval`` (one of
        :meth:`consumer_slices`) stand for in the current epoch: the positions themselves, or with
        ``shuffle_within_shard`` their images under the epoch's
        :class:`~uc_checkpoint.data.shuffle.ShardPermutation` of the shard."""
        shard = self._config.shards[interval.shard]
        if not self._config.shuffle_within_shard:
            return np.arange(interval.start, interval.end, dtype=np.int64)
        permutation = ShardPermutation(self._config.seed, self._epoch, shard.name, shard.num_samples)
        return permutation.indices(interval.start, interval.end)

    def _slice_samples(self, worker: int, start: int, end: int) -> list[tuple[int, np.ndarray]]:
        """``(shard, sample indices)`` of samples ``start .. end - 1`` of consumer ``worker``'s slice."""
        out = []
        for iv in drop_prefix(self._slices[self.consumer_id(worker)], start):
            take = min(iv.size, end - start)
            if take <= 0:
                break
            out.append((iv.shard, self.sample_indices(Interval(iv.shard, iv.start, iv.start + take))))
            start += take
        return out

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
        workers = range(self._config.workers_per_rank) if worker is None else [worker]
        return sum(self._slice_sizes[self.consumer_id(w)] - self._consumed[w] for w in workers)

    def rank_exhausted(self) -> bool:
        """True when every consumer of this rank has consumed its whole slice (other ranks may still
        have a few samples; see "Uneven ends" in ``docs/data-tracker.md``)."""
        return self.samples_left() == 0

    def sync_from_main_process(self, epoch: int, assignment_id: str, consumed: Sequence[int]) -> bool:
        """Bring a copy of the tracker that lives in a data-loader worker to the main process's state.

        ``epoch``, ``assignment_id`` and ``consumed`` (one count per worker) come from the main
        process's tracker. A copy can follow a new epoch on its own (the work is a function of
        ``(seed, epoch)``); it cannot follow a :meth:`load_global_state` made after it was copied.
        Returns False in that case (the worker must be restarted with a fresh copy), True otherwise.

        Raises:
            ValueError: ``consumed`` has not one count per worker, or a count is negative.
        """
        if assignment_id != self._assignment:
            self._set_work(epoch, whole_epoch(self._config.shards, self._config.seed, epoch), SampleDigest())
            self._source = _Source.EPOCH
            if assignment_id != self._assignment:
                return False
        if len(consumed) != self._config.workers_per_rank:
            raise ValueError(
                f"sync_from_main_process() got {len(consumed)} consumed counts for {self._config.workers_per_rank} workers"
            )
        for w, k in enumerate(consumed):
            self._consumed[w] = check_int(int(k), f"worker {w} consumed", minimum=0)
        return True

    def resume_summary(self, max_names: int = 8) -> dict[str, Any]:
        """What a run resumed from this tracker's current work skips and where it seeks: for logs.

        Returns ``{"epoch", "samples_consumed_in_epoch", "samples_remaining", "skipped_shards" (count of
        shards with no work left in the epoch), "skipped_names" (at most ``max_names`` of them),
        "partial_shards" ([name, samples already consumed, shard size] of shards with work left that
        was partly consumed), "seeks" ([rank, worker, shard name, offset] of every consumer whose next
        sample is not at the start of a shard)}``.
        """
        return resume_summary(
            self._config.shards, self._config.workers_per_rank, self._epoch, self._base, self._slices, max_names
        )

    # ------------------------------------------------------------------ state

    def local_state(self) -> dict[str, Any]:
        """This rank's progress, to be gathered from all ranks for :meth:`global_state`.

        ``{"rank": int, "consumed": [samples consumed per worker], "epoch": int, "assignment": str,
        "digest": [[shard, count, hash], ...] | None, "next_worker": int}``; ``epoch`` and ``assignment``
        (a short id of the current work split) let the merge check that all ranks describe the same
        assignment; ``digest`` is the :class:`~uc_checkpoint.data.digest.SampleDigest` of what this
        rank consumed in it (None with ``exactly_once="off"``); ``next_worker`` is :attr:`next_worker`.
        """
        digest = None
        if self._config.exactly_once != "off":
            self._ledger.flush(self._hasher, self._slice_samples)
            digest = self._ledger.local.to_list()
        return {
            "rank": self._config.rank,
            "consumed": list(self._consumed),
            "epoch": self._epoch,
            "assignment": self._assignment,
            "digest": digest,
            "next_worker": self._next_worker,
        }

    def _merge(self, local_states: Sequence[dict[str, Any]]) -> tuple[list[int], SampleDigest | None]:
        """Consumed counts of all consumers and the epoch's digest so far (None: not checkable)."""
        consumed, ranks = merge_local_states(
            local_states,
            world_size=self._config.world_size,
            workers_per_rank=self._config.workers_per_rank,
            epoch=self._epoch,
            assignment=self._assignment,
            slice_sizes=self._slice_sizes,
            num_shards=len(self._config.shards),
        )
        return consumed, self._ledger.epoch_digest(ranks) if self._config.exactly_once != "off" else None

    def _check_epoch(self, digest: SampleDigest | None) -> None:
        """The end-of-epoch exactly-once check, once per assignment (see ``exactly_once``)."""
        mode = self._config.exactly_once
        if mode == "off" or self._ledger.checked:
            return
        self._ledger.checked = True
        if digest is None:
            logger.info(
                "data tracker: epoch %d is not checked for exactly-once: its digest is incomplete (the dataset "
                "changed during the epoch, or part of it ran with exactly_once='off')",
                self._epoch,
            )
            return
        report = check_digest(self._hasher, [s.num_samples for s in self._config.shards], digest)
        enforce(report, mode, self._epoch)

    def global_state(
        self, local_states: Sequence[dict[str, Any]], *, include_shard_list: bool = True
    ) -> dict[str, Any]:
        """The checkpointable data state, from the :meth:`local_state` of every rank.

        Every rank computes the same dict from the same gathered list. Keys (the format is
        :class:`~uc_checkpoint.data.state.TrackerState`'s):

        * ``format``: :data:`STATE_FORMAT`.
        * ``fingerprint``: :func:`dataset_fingerprint` of the dataset.
        * ``seed``, ``epoch``: the shard-order seed and the current epoch.
        * ``shuffle_within_shard``: whether positions map to samples through a permutation.
        * ``remaining``: ``[[shard, start, end], ...]`` in stream order, the positions of this epoch
          not consumed yet (empty: the epoch is finished).
        * ``samples_consumed_in_epoch``: samples of the epoch no longer to be read.
        * ``num_shards``: number of shards of the dataset.
        * ``digest``: ``[[shard, count, hash], ...]``, the digest of the samples the epoch consumed
          (across ranks and resumes), or None when it cannot be checked; about 45 bytes per shard
          touched.
        * ``shards`` (when ``include_shard_list``): ``[[name, num_samples, fingerprint], ...]``, so that
          a load on a changed dataset can name the shard that differs and map the remaining work by
          shard name. It costs about ``len(name) + len(fingerprint) + 15`` bytes per shard; turn it
          off for very many shards.
        * ``consumers`` (when the work is not cut as a fresh cut would be, e.g. a DataLoader's workers
          stopped mid-turn): the :class:`~uc_checkpoint.data.layout.ConsumerLayout`, each consumer's
          remaining samples and each rank's :attr:`next_worker`, with which a run of the same world
          size, workers and ``batch_size`` resumes batch for batch.

        All values are plain bools, ints, strings, lists and None (JSON-serialisable). A state whose
        remaining work is empty also runs the end-of-epoch check (see ``exactly_once``).

        Raises:
            TrackerStateError: a gathered local state is malformed or from another assignment.
            ExactlyOnceError: the epoch is finished, ``exactly_once="raise"`` and the check failed.
        """
        consumed, digest = self._merge(local_states)
        remaining = coalesce(iv for c, piece in enumerate(self._slices) for iv in drop_prefix(piece, consumed[c]))
        cfg = self._config
        shard_list = tuple((s.name, s.num_samples, s.fingerprint) for s in cfg.shards) if include_shard_list else None
        left = total_size(remaining)
        if not left:
            self._check_epoch(digest)
        layout = ConsumerLayout(
            cfg.world_size,
            cfg.workers_per_rank,
            cfg.batch_size,
            tuple(size - k for size, k in zip(self._slice_sizes, consumed)),
            gathered_next_workers(local_states, cfg.workers_per_rank),
        )
        state = TrackerState(
            cfg.fingerprint,
            cfg.seed,
            self._epoch,
            tuple(remaining),
            cfg.total_samples - left,
            len(cfg.shards),
            shard_list,
            cfg.shuffle_within_shard,
            digest,
            None if layout.is_even() else layout,
        )
        return state.to_dict()

    def epoch_done(self, local_states: Sequence[dict[str, Any]] | None = None) -> bool:
        """True when no rank has work left in the current epoch (the global remaining work is empty).

        Pass the gathered :meth:`local_state` of all ranks; with ``world_size == 1`` they may be
        omitted. (From one rank alone only :meth:`rank_exhausted` can be known.) The first call that
        finds the epoch finished runs the end-of-epoch exactly-once check (see ``exactly_once``).

        Raises:
            ValueError: no local states given while ``world_size > 1``.
            TrackerStateError: a gathered local state is malformed or from another assignment.
            ExactlyOnceError: the epoch is finished, ``exactly_once="raise"`` and the check failed.
        """
        if local_states is None:
            if self._config.world_size != 1:
                raise ValueError(
                    "epoch_done() needs the gathered local states of all ranks when world_size > 1 "
                    "(use rank_exhausted() for this rank alone)"
                )
            local_states = [self.local_state()]
        consumed, digest = self._merge(local_states)
        done = all(k == size for k, size in zip(consumed, self._slice_sizes))
        if done:
            self._check_epoch(digest)
        return done

    def load_global_state(self, state: dict[str, Any]) -> None:
        """Restore the epoch and remaining work from :meth:`global_state` (of this or any other
        topology) and cut the remaining work for this tracker's rank, world size and workers.

        The checkpoint's seed replaces the tracker's (a warning says so when they differ) so that later
        epochs follow the saved run's order. Every load replaces the work, even a reload of the state
        the tracker already holds: :attr:`generation` goes up, so that a data-loader iterator created
        before the load refuses to go on (it would read the old work) instead of drifting from what
        the tracker records. Nothing changes when the state is refused. The checkpoint's
        ``shuffle_within_shard`` replaces the tracker's too, and its digest of the samples consumed so
        far carries on into the end-of-epoch check. A shard whose fingerprint is unknown (``""``) on
        either side is matched by name and count alone.

        Raises:
            DatasetMismatchError: the state was written for a different dataset (names, counts, order,
                or the content fingerprint of a shard: the message names the shard and both) and
                ``allow_dataset_change`` is False. With it True, the remaining work is carried over
                shard by shard (:func:`~uc_checkpoint.data.dataset_change.carry_over`: by shard name
                when the state has the shard list, else by index) and a warning says what changed;
                unread samples that cannot be carried over (their shard is gone or renamed, or too
                short now, or shuffled and resized) raise it naming each such shard and its count,
                unless ``drop_unmapped`` (then they are dropped and listed in :attr:`dataset_change`).
                Shards or samples added since are read from the next epoch on.
                The dataset a state names does not depend on where it is stored: shard names are
                relative and fingerprints describe content (:class:`ShardSpec`).
            TrackerStateError: (a ``ValueError``) the state is not a dict, has another ``format``, a
                missing or unknown key, a field of the wrong type or out of range, remaining work that
                overlaps, is out of stream order or exceeds its shard, or counts that do not add up to
                the dataset. The message names the field (see :class:`~uc_checkpoint.data.state.TrackerState`).
        """
        loaded = TrackerState.from_dict(state)
        consumed_before = loaded.digest
        change = None
        layout = None
        if loaded.same_dataset(self._config.shards):
            loaded.check_fits(self._config.shards)
            remaining = list(loaded.remaining)
            layout = usable_layout(loaded.consumers, self._config)
        else:
            remaining, change = carry_over_state(loaded, self._config)
            consumed_before = None  # samples were dropped or changed: the epoch cannot be checked
        if loaded.seed != self._config.seed:
            logger.warning(
                "data tracker: the checkpoint's shard-order seed %d replaces the configured seed %d",
                loaded.seed,
                self._config.seed,
            )
            self._config = dataclasses.replace(self._config, seed=loaded.seed)
        if loaded.shuffle_within_shard != self._config.shuffle_within_shard:
            logger.warning(
                "data tracker: the checkpoint's shuffle_within_shard=%s replaces the configured %s (the "
                "saved positions mean the samples of that order)",
                loaded.shuffle_within_shard,
                self._config.shuffle_within_shard,
            )
            self._config = dataclasses.replace(self._config, shuffle_within_shard=loaded.shuffle_within_shard)
        self._set_work(loaded.epoch, remaining, consumed_before, layout)
        self._source = _Source.LOADED
        self._load_count += 1
        self._dataset_change = change
        logger.info(
            "data tracker: rank %d restored epoch %d, %d samples remaining, split over %d consumers (%d for this rank)",
            self._config.rank,
            loaded.epoch,
            total_size(self._base),
            self._config.num_consumers,
            self.samples_left(),
        )


__all__ = [
    "STATE_FORMAT",
    "DataTracker",
    "DatasetChange",
    "DatasetMismatchError",
    "Interval",
    "ShardSpec",
    "TrackerConfig",
    "TrackerState",
    "TrackerStateError",
    "assign",
    "dataset_fingerprint",
    "epoch_shard_order",
    "iter_positions",
    "slice_sizes",
]
