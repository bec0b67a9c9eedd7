"""Within-shard shuffling and the exactly-once check behind real DataLoader workers (forked processes).

A list-backed random-access reader (``read_indices``) serves samples ``(shard, index, worker)``; the
worker id is added by the transform, in the worker, so that each consumer's reads can be followed.
Ranks are simulated in one process, their local states gathered by hand (as in test_data_loading.py).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import pytest
from torch.utils.data import get_worker_info

from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.data.shuffle import ShardPermutation
from uc_checkpoint.data.tracker import DataTracker, ShardSpec
from uc_checkpoint.errors import ExactlyOnceError

SIZES = (7, 0, 23, 5, 16, 11)
SHARDS = [ShardSpec(f"part-{i:03d}", n) for i, n in enumerate(SIZES)]
SEED = 3


class ListReader:
    """Random-access reader over in-memory shards: sample ``k`` of shard ``i`` is ``(i, k)``.
    ``swap={(i, k): j}`` returns sample ``j`` where ``k`` is asked for (one skipped, one repeated)."""

    random_access = True

    def __init__(self, swap: dict[tuple[int, int], int] | None = None) -> None:
        self.data = {s.name: [(i, k) for k in range(s.num_samples)] for i, s in enumerate(SHARDS)}
        self.swap = swap or {}

    def _get(self, shard: ShardSpec, index: int) -> tuple[int, int]:
        i, k = self.data[shard.name][index]
        return self.data[shard.name][self.swap.get((i, k), k)]

    def __call__(self, shard: ShardSpec, start: int, end: int):
        for k in range(start, end):
            yield self._get(shard, k)

    def read_indices(self, shard: ShardSpec, indices):
        for k in indices:
            yield self._get(shard, int(k))


def with_worker(sample: tuple[int, int]) -> tuple[int, int, int]:
    info = get_worker_info()
    return (*sample, 0 if info is None else info.id)


def index_of(sample: tuple[int, int]) -> int:
    return sample[1]


def make(world: int, workers: int, *, reader: Any = None, batch_size: int = 3, tracker_kw=None, **kw: Any):
    trackers = [
        DataTracker(
            SHARDS,
            seed=SEED,
            rank=r,
            world_size=world,
            num_workers=workers,
            shuffle_within_shard=True,
            **(tracker_kw or {}),
        )
        for r in range(world)
    ]
    loaders = [
        TrackedDataLoader(
            TrackedShardDataset(t, reader or ListReader(), transform=with_worker, sample_index=index_of),
            batch_size=batch_size,
            num_workers=workers,
            **kw,
        )
        for t in trackers
    ]
    return trackers, loaders


def consume(loaders, batches: list[int] | None, reads: dict, run: str) -> None:
    """Each rank's loader for so many batches (None: to the end); ``reads[(run, rank, worker)]``
    gets the ``(shard, index)`` pairs the training loop received, in order."""
    for r, loader in enumerate(loaders):
        limit = None if batches is None else batches[r]
        if limit == 0:
            continue
        for n, (shard, index, worker) in enumerate(loader):
            for s, k, w in zip(shard.tolist(), index.tolist(), worker.tolist()):
                reads.setdefault((run, r, w), []).append((s, k))
            if limit is not None and n + 1 == limit:
                break


def shard_orders(reads: dict) -> dict[int, list[int]]:
    """Checks each consumer read its part of every shard in the shard's permutation order, and
    returns every shard's samples put back in position order."""
    placed: dict[int, list[tuple[int, int]]] = {}
    for pairs in reads.values():
        for shard in {s for s, _k in pairs}:
            spec = SHARDS[shard]
            perm = ShardPermutation(SEED, 0, spec.name, spec.num_samples).indices(0, spec.num_samples).tolist()
            at = [perm.index(k) for s, k in pairs if s == shard]
            assert at == sorted(at), f"a consumer read shard {shard} out of its permutation order"
            placed.setdefault(shard, []).extend((p, perm[p]) for p in at)
    return {s: [k for _p, k in sorted(v)] for s, v in placed.items()}


@pytest.mark.parametrize(("before", "after", "cut"), [((2, 2), (1, 3), [3, 2]), ((1, 0), (2, 2), [4])])
def test_shuffled_epoch_interrupted_and_resumed_on_another_topology(before, after, cut) -> None:
    whole: dict = {}
    _, loaders = make(1, 2)
    consume(loaders, None, whole, "whole")  # world size 1: the iterator's end ran the check

    reads: dict = {}
    trackers, loaders = make(*before, **({"prefetch_factor": 4} if before[1] else {}))  # prefetched, not consumed
    consume(loaders, cut, reads, "first")
    state = json.loads(json.dumps(trackers[0].global_state([t.local_state() for t in trackers])))
    assert state["digest"] and state["shuffle_within_shard"]
    trackers2, loaders2 = make(*after)
    for t in trackers2:
        t.load_global_state(state)
    consume(loaders2, None, reads, "second")
    gathered = [t.local_state() for t in trackers2]
    assert trackers2[0].epoch_done(gathered)  # the exactly-once check over both runs passed
    final = trackers2[0].global_state(gathered)
    assert sum(c for _s, c, _h in final["digest"]) == sum(SIZES)

    every = Counter((i, k) for i, n in enumerate(SIZES) for k in range(n))
    assert Counter(p for v in reads.values() for p in v) == every
    assert shard_orders(reads) == shard_orders(whole)  # each shard's order is the uninterrupted run's
    assert any(v != sorted(v) for v in shard_orders(whole).values())  # and really shuffled


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reader_that_skips_and_repeats_a_sample_fails_the_check(workers: int) -> None:
    _, loaders = make(1, workers, reader=ListReader(swap={(2, 4): 9}))  # sample 9 twice, 4 never
    with pytest.raises(ExactlyOnceError, match=r"shard 2 'part-002': 23 consumed, k >= 1 skipped and as many repeated"):
        consume(loaders, None, {}, "run")


def test_warn_mode_logs_and_goes_on(caplog) -> None:
    trackers, loaders = make(1, 2, reader=ListReader(swap={(4, 0): 1}), tracker_kw={"exactly_once": "warn"})
    with caplog.at_level(logging.WARNING, logger="uc_checkpoint.data.digest"):
        consume(loaders, None, {}, "run")
    assert "exactly-once check of epoch 0 failed" in caplog.text and "'part-004'" in caplog.text
    trackers[0].start_epoch(1)  # checked once: no second warning
    assert caplog.text.count("exactly-once check of epoch 0 failed") == 1


def drop_every_fifth(sample: tuple[int, int]) -> tuple[int, int, int] | None:
    return None if sample[1] % 5 == 4 else with_worker(sample)


def test_samples_dropped_by_the_transform_and_drop_last_still_count_once() -> None:
    tracker = DataTracker(SHARDS, seed=SEED, num_workers=2, batch_size=4)
    loader = TrackedDataLoader(
        TrackedShardDataset(tracker, ListReader(), transform=drop_every_fifth, sample_index=index_of),
        batch_size=4,
        num_workers=2,
        drop_last=True,
    )
    for _batch in loader:  # the pass's end records the dropped samples and runs the check
        pass
    state = tracker.global_state([tracker.local_state()])
    assert state["remaining"] == [] and sum(c for _s, c, _h in state["digest"]) == sum(SIZES)


def plain_reader(shard: ShardSpec, start: int, end: int):
    yield from ((0, k) for k in range(start, end))


def test_shuffling_needs_a_random_access_reader() -> None:
    tracker = DataTracker(SHARDS, shuffle_within_shard=True)
    with pytest.raises(TypeError, match="needs a random-access reader .*plain_reader"):
        TrackedShardDataset(tracker, plain_reader)

    class Sequential(ListReader):
        random_access = False

    with pytest.raises(TypeError, match="Sequential"):
        TrackedShardDataset(tracker, Sequential())
