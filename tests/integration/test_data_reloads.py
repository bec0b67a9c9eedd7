"""Loads, reloads and epoch restarts into a data loader that is already running (issue 14, item 5).

Every load or ``start_epoch`` that replaces the tracker's work must either show from the next
iterator's first batch or be refused with a ``DataLoadingError`` at the stale iterator's next batch;
it must never let the batches handed out drift from what the tracker records, nor kill a worker.
Each test checks the exact samples: across the interrupted and the resumed passes every sample of the
epoch is delivered exactly once. Real ``DataLoader`` worker processes (forked), torchdata's
``StatefulDataLoader`` when installed, and DCP save/load through the volume plugin.

Also here: ``drop_last`` with a batch-aligned tracker (a resumed epoch drops no more than an
uninterrupted one). Malformed tracker states and the loader's refusals, which need no worker:
tests/unit/test_data_inputs.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader

from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.data.tracker import DataTracker, ShardSpec, iter_positions
from uc_checkpoint.errors import DataLoadingError

SIZES = (7, 0, 11, 5, 9)  # 32 samples; an empty shard on the way
SHARDS = [ShardSpec(f"part-{i}", n) for i, n in enumerate(SIZES)]
INDEX = {s.name: i for i, s in enumerate(SHARDS)}
SEED = 5
STALE = r"work changed since .* Create a new iterator: iter\(loader\)"
NEWER = r"a newer iterator of this TrackedDataLoader"


def read_shard(shard: ShardSpec, start: int, end: int):
    """Seeks to ``start``; a sample is its own ``(shard index, offset)``."""
    for offset in range(start, end):
        yield (INDEX[shard.name], offset)


def epoch_samples(shards: list[ShardSpec] = SHARDS) -> Counter:
    return Counter((i, k) for i, s in enumerate(shards) for k in range(s.num_samples))


def loader_class(kind: str) -> type:
    if kind == "stateful":
        return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    return DataLoader


def make(
    workers: int,
    *,
    kind: str = "plain",
    persistent: bool = False,
    batch_size: int = 3,
    shards: list[ShardSpec] = SHARDS,
    rank: int = 0,
    world: int = 1,
    tracker_batch: int = 1,
    **kwargs: Any,
) -> tuple[DataTracker, TrackedDataLoader]:
    tracker = DataTracker(shards, seed=SEED, rank=rank, world_size=world, num_workers=workers, batch_size=tracker_batch)
    if persistent:
        kwargs["persistent_workers"] = True
    loader = TrackedDataLoader(
        TrackedShardDataset(tracker, read_shard),
        loader_cls=loader_class(kind),
        batch_size=batch_size,
        num_workers=workers,
        **kwargs,
    )
    return tracker, loader


def pairs(batch: Any) -> list[tuple[int, int]]:
    shard, offset = batch
    return list(zip(shard.tolist(), offset.tolist()))


def take(it: Any, batches: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for _ in range(batches):
        out += pairs(next(it))
    return out


def drain(loader: TrackedDataLoader) -> list[tuple[int, int]]:
    """A new iterator, to the end of this rank's work."""
    return [p for batch in loader for p in pairs(batch)]


def consumed_in(state: dict[str, Any], shards: list[ShardSpec] = SHARDS) -> Counter:
    """The samples a ``loader.state_dict()`` says were consumed: the epoch minus its remaining work."""
    glob = json.loads(state["global_state"])
    left = Counter((s, k) for s, a, b in glob["remaining"] for k in range(a, b))
    return epoch_samples(shards) - left


def worker_pids(loader: TrackedDataLoader) -> list[int]:
    return [p.pid for p in loader._loader._iterator._workers]


# ---------------------------------------------------------------------------------------------------
# Input A: a persistent-worker loader reloads the state it resumed from, after a later epoch began.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "kind", "persistent", "via_dcp"),
    [
        (1, "plain", True, False),  # the input
        (1, "plain", True, True),  # the same through dcp.save/dcp.load on the volume
        (2, "plain", True, False),
        (2, "plain", False, False),
        (2, "stateful", True, False),
        (0, "plain", False, False),
    ],
)
def test_reloading_the_resumed_state_after_a_later_epoch(
    workers: int, kind: str, persistent: bool, via_dcp: bool, tmp_path: Path, staging: Path
) -> None:
    ckpt = str(tmp_path / "ckpt")

    def save(loader: TrackedDataLoader) -> dict[str, Any]:
        if via_dcp:
            dcp.save({"data": loader}, storage_writer=UCVolumeWriter(ckpt))
        return loader.state_dict()

    def load(loader: TrackedDataLoader, state: dict[str, Any]) -> None:
        if via_dcp:
            dcp.load({"data": loader}, storage_reader=UCVolumeReader(ckpt))
        else:
            loader.load_state_dict(state)

    _, first = make(workers, kind=kind, persistent=persistent)
    for batch in first:
        run1 = pairs(batch)
        break
    saved = save(first)
    assert consumed_in(saved) == Counter(run1)

    tracker, loader = make(workers, kind=kind, persistent=persistent)
    load(loader, saved)
    for batch in loader:
        lost = pairs(batch)  # consumed after the checkpoint: undone by the reload below
        break
    tracker.start_epoch(1)
    for batch in loader:
        epoch1 = pairs(batch)
        break
    pids = worker_pids(loader) if persistent else None
    fresh = DataTracker(SHARDS, seed=SEED, num_workers=workers)
    fresh.start_epoch(1)
    assert epoch1 == list(iter_positions(fresh.consumer_slices(0)))[:3]  # worker 0's first batch

    load(loader, saved)  # the same state again, into live (persistent) workers now in epoch 1
    rest = drain(loader)
    assert tracker.epoch == 0 and tracker.epoch_done()
    assert Counter(run1) + Counter(rest) == epoch_samples()  # each sample of epoch 0 exactly once
    assert set(lost) <= set(rest)  # what the reload undid is read again
    if persistent:
        assert set(worker_pids(loader)).isdisjoint(pids)  # restarted: their copies cannot follow a load


def test_persistent_workers_follow_epochs_and_restart_only_after_a_load() -> None:
    """An older state loaded into persistent workers that are mid-epoch restarts them once; epochs
    after that are followed by the same processes again."""
    tracker, loader = make(2, persistent=True)
    it = iter(loader)
    run1 = take(it, 2)
    older = loader.state_dict()
    take(it, 3)
    pids = worker_pids(loader)
    loader.load_state_dict(older)
    rest = drain(loader)
    restarted = worker_pids(loader)
    assert set(restarted).isdisjoint(pids)
    assert Counter(run1) + Counter(rest) == epoch_samples()
    for epoch in (1, 2):
        tracker.start_epoch(epoch)
        assert Counter(drain(loader)) == epoch_samples()
        assert worker_pids(loader) == restarted  # no restart without a load


# ---------------------------------------------------------------------------------------------------
# Input B: a load (or start_epoch) while an iterator is live.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "kind", "persistent", "which"),
    [
        (0, "plain", False, "start"),  # the input: the state before the iterator
        (2, "plain", False, "start"),
        (2, "plain", True, "older"),  # a state saved after one batch, two batches back
        (1, "stateful", False, "same"),  # the state the tracker is at right now
        (3, "stateful", True, "start"),
    ],
)
def test_load_into_a_live_iterator_is_refused_and_the_next_iterator_follows(
    workers: int, kind: str, persistent: bool, which: str
) -> None:
    tracker, loader = make(workers, kind=kind, persistent=persistent)
    it = iter(loader)
    if which == "start":
        state, before = loader.state_dict(), []
        take(it, 2)
    elif which == "older":
        before = take(it, 1)
        state = loader.state_dict()
        take(it, 2)
    else:
        before = take(it, 2)
        state = loader.state_dict()
    generation = tracker.generation
    loader.load_state_dict(state)
    assert tracker.generation == generation + 1  # even the same state replaces the work
    with pytest.raises(DataLoadingError, match=STALE):
        next(it)
    with pytest.raises(DataLoadingError, match=STALE):
        next(it)  # still refused, never a silent end of the pass
    assert loader.state_dict() == state  # the refused batch was not recorded
    rest = drain(loader)
    assert Counter(before) + Counter(rest) == epoch_samples()
    assert tracker.epoch_done()


@pytest.mark.parametrize("workers", [0, 2])
def test_start_epoch_of_the_current_epoch_mid_iteration(workers: int) -> None:
    """start_epoch(e) for the epoch in progress (not a restored one) restarts it: the live iterator
    is refused and the next one reads the whole epoch."""
    tracker, loader = make(workers)
    it = iter(loader)
    take(it, 2)
    tracker.start_epoch(0)
    with pytest.raises(DataLoadingError, match=STALE):
        next(it)
    assert tracker.samples_left() == sum(SIZES)
    assert Counter(drain(loader)) == epoch_samples()


@pytest.mark.parametrize("workers", [0, 2])
def test_load_before_start_epoch_keeps_the_live_iterator(workers: int) -> None:
    """The loop idiom: load, then start_epoch(restored epoch). That start_epoch keeps the restored
    work, so an iterator created between the two goes on, and nothing is read twice."""
    _, first = make(workers)
    it0 = iter(first)
    run1 = take(it0, 3)
    saved = first.state_dict()

    tracker, loader = make(workers)
    loader.load_state_dict(saved)
    it = iter(loader)
    part = take(it, 1)
    generation = tracker.generation
    tracker.start_epoch(tracker.epoch)
    assert tracker.generation == generation
    part += [p for batch in it for p in pairs(batch)]
    assert Counter(run1) + Counter(part) == epoch_samples()
    assert tracker.epoch_done()


def test_load_after_start_epoch_refuses_the_iterator_of_the_new_epoch() -> None:
    """start_epoch(1), an iterator of epoch 1, then the epoch-0 state is loaded: the epoch-1
    iterator is refused and the next iterator finishes epoch 0."""
    _, first = make(2)
    it0 = iter(first)
    run1 = take(it0, 2)
    saved = first.state_dict()

    tracker, loader = make(2)
    tracker.start_epoch(1)
    it = iter(loader)
    take(it, 1)
    loader.load_state_dict(saved)
    with pytest.raises(DataLoadingError, match=r"created for epoch 1 .* now epoch 0"):
        next(it)
    assert Counter(run1) + Counter(drain(loader)) == epoch_samples()


@pytest.mark.parametrize("persistent", [False, True])
def test_a_newer_iterator_retires_the_older_one(persistent: bool) -> None:
    """Two live iterators of one loader would read the same samples (persistent ones even share the
    workers): only the newest hands out batches."""
    tracker, loader = make(2, persistent=persistent)
    old = iter(loader)
    got = take(old, 3)
    new = iter(loader)
    with pytest.raises(DataLoadingError, match=NEWER):
        next(old)
    got += [p for batch in new for p in pairs(batch)]
    assert Counter(got) == epoch_samples()
    assert tracker.epoch_done()


def test_a_worker_that_missed_a_load_raises_in_the_training_loop() -> None:
    """The defence behind the loader's restart, for a loader of one's own that keeps persistent
    workers across a load: the worker's copy cannot follow the loaded work, and the training loop
    gets a DataLoadingError naming the load (not a dead worker, not batches of the old work)."""
    tracker = DataTracker(SHARDS, seed=SEED, num_workers=1)
    dataset = TrackedShardDataset(tracker, read_shard)
    plain = DataLoader(dataset, batch_size=None, num_workers=1, persistent_workers=True)
    first = [(t.worker, t.item) for t in plain]  # tagged items: this plain loader records nothing
    assert Counter(item for _, item in first) == epoch_samples()
    other = DataTracker(SHARDS, seed=SEED)
    other.record(0, 6)
    tracker.load_global_state(other.global_state([other.local_state()]))
    dataset.publish_progress()
    with pytest.raises(DataLoadingError, match="worker 0 cannot follow a DataTracker.load_global_state"):
        next(iter(plain))
    # The worker survived the refusal: a new epoch, which it can follow, is read in full.
    tracker.start_epoch(1)
    dataset.publish_progress()
    assert Counter(t.item for t in plain) == epoch_samples()


# ---------------------------------------------------------------------------------------------------
# drop_last: a batch-aligned tracker drops the same samples however often an epoch is resumed.
# ---------------------------------------------------------------------------------------------------

SHARDS50 = [ShardSpec("a", 20), ShardSpec("b", 17), ShardSpec("c", 13)]  # 50 samples
INDEX.update({s.name: i for i, s in enumerate(SHARDS50)})


def make50(workers: int, rank: int = 0, world: int = 1) -> tuple[DataTracker, TrackedDataLoader]:
    return make(workers, shards=SHARDS50, batch_size=4, tracker_batch=4, drop_last=True, rank=rank, world=world)


def drain_full_batches(loader: TrackedDataLoader) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for batch in loader:
        assert len(batch[0]) == 4  # drop_last: never a short batch
        out += pairs(batch)
    return out


def test_drop_last_uninterrupted_epoch_drops_total_mod_batch() -> None:
    tracker, loader = make50(2)
    got = drain_full_batches(loader)
    assert len(got) == 48 == len(set(got))  # 50 % 4 = 2 dropped, the rest once each
    assert tracker.epoch_done()  # the dropped partial batch counts as consumed


@pytest.mark.parametrize(
    "resumes",
    [
        [(1, 2)],  # the case: 2 workers, resumed with the same topology after 3 batches
        [(1, 3)],  # resumed onto 3 workers
        [(1, 0), (2, 1)],  # main process, then two ranks of one worker
        [(1, 2), (1, 2), (1, 2)],  # resumed three times
    ],
)
def test_drop_last_resumed_epoch_drops_no_more(resumes: list[tuple[int, int]]) -> None:
    trackers, loaders = zip(*[make50(2)])
    delivered: list[tuple[int, int]] = []
    batches_before_save = 3
    for world, workers in resumes:
        # Each rank runs some batches, then the preempted run saves; what it read after is lost.
        for loader in loaders:
            it = iter(loader)
            for _ in range(batches_before_save):
                batch = next(it, None)
                if batch is not None:
                    assert len(batch[0]) == 4
                    delivered += pairs(batch)
        state = trackers[0].global_state([t.local_state() for t in trackers])
        trackers, loaders = zip(*[make50(workers, rank=r, world=world) for r in range(world)])
        for t in trackers:
            t.load_global_state(state)
        batches_before_save = 1
    for loader in loaders:
        delivered += drain_full_batches(loader)
    assert len(delivered) == 48 == len(set(delivered))  # no more dropped than without interruption
    assert set(delivered) <= set(epoch_samples(SHARDS50))
    assert trackers[0].epoch_done([t.local_state() for t in trackers])
