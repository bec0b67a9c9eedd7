"""Within-shard shuffling: ShardPermutation is a deterministic bijection per (seed, epoch, shard), and
a tracker that shuffles keeps its promise across resumes onto other world sizes and worker counts.

The promise (docs/data-tracker.md, "Within-shard shuffling"): epoch ``e`` reads shard ``s`` in the
order ``perm = ShardPermutation(seed, e, s.name, s.num_samples).indices(0, n)``; every consumer reads
its part of a shard in ``perm``'s order (one contiguous block of it in a run without resumes; after a
resume, the pieces of ``perm`` its slice holds, in order), and the parts of all consumers of all runs
of the epoch (interrupted, resumed on any topology) tile ``perm`` exactly once. So each shard's order,
parts put back by position, is the uninterrupted run's; only the interleaving of consumers (which
rank reads which part when) depends on the topology.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uc_checkpoint.data.intervals import Interval, ShardSpec
from uc_checkpoint.data.shuffle import ShardPermutation
from uc_checkpoint.data.tracker import DataTracker


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(-(2**40), 2**40), epoch=st.integers(0, 50))
def test_every_index_exactly_once_and_any_window_agrees(n: int, seed: int, epoch: int) -> None:
    perm = ShardPermutation(seed, epoch, "shard", n)
    full = perm.indices(0, n)
    assert full.dtype == np.int64 and len(full) == n
    assert sorted(full.tolist()) == list(range(n))
    if n:
        a, b = sorted(random.Random(n).sample(range(n + 1), 2))
        assert perm.indices(a, b).tolist() == full[a:b].tolist()  # a resumed consumer's window


def test_deterministic_and_different_per_epoch_shard_and_seed() -> None:
    n = 1000
    base = ShardPermutation(7, 3, "part-001", n).indices(0, n).tolist()
    assert ShardPermutation(7, 3, "part-001", n).indices(0, n).tolist() == base  # a fresh instance
    for other in [
        ShardPermutation(7, 4, "part-001", n),  # epoch
        ShardPermutation(7, 3, "part-002", n),  # shard
        ShardPermutation(8, 3, "part-001", n),  # seed
    ]:
        assert other.indices(0, n).tolist() != base
    assert base != list(range(n))


def test_order_is_pinned() -> None:
    """A saved run's positions mean these samples: the order must never change."""
    assert ShardPermutation(0, 1, "a", 10).indices(0, 10).tolist() == [0, 9, 5, 2, 8, 6, 7, 1, 3, 4]
    assert ShardPermutation(0, 2, "a", 10).indices(0, 10).tolist() == [1, 0, 5, 2, 9, 6, 3, 4, 7, 8]


def test_large_shard_across_chunks_is_a_permutation() -> None:
    n = 200_003  # several vectorised chunks, odd size
    full = ShardPermutation(1, 0, "big", n).indices(0, n)
    assert np.array_equal(np.sort(full), np.arange(n))
    assert np.array_equal(ShardPermutation(1, 0, "big", n).indices(65_000, 140_000), full[65_000:140_000])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="outside the shard"):
        ShardPermutation(0, 0, "a", 5).indices(2, 6)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        ShardPermutation(0, -1, "a", 5)
    with pytest.raises(TypeError, match="shard_name must be a str"):
        ShardPermutation(0, 0, 3, 5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# The tracker's promise across resumes
# ---------------------------------------------------------------------------------------------------


def make_trackers(shards, world: int, workers: int, **kw) -> list[DataTracker]:
    return [
        DataTracker(shards, seed=5, rank=r, world_size=world, num_workers=workers, shuffle_within_shard=True, **kw)
        for r in range(world)
    ]


def run(trackers, rnd: random.Random | None, reads: dict, tag: str) -> None:
    """Every consumer reads its slices' sample indices (as a worker does) and consumes a random
    prefix of them (all with ``rnd`` None), recording it; ``reads[(tag, rank, worker)]`` gets the
    ``(shard, index)`` pairs in consumption order."""
    for t in trackers:
        for w in range(t.config.workers_per_rank):
            pairs = [(iv.shard, int(i)) for iv in t.consumer_slices(w) for i in t.sample_indices(iv)]
            take = len(pairs) if rnd is None else rnd.randint(0, len(pairs))
            t.record(w, take)
            reads[(tag, t.config.rank, w)] = pairs[:take]


def per_shard_order(reads: dict, perms: dict[int, list[int]], *, one_block: bool = False) -> dict[int, list[int]]:
    """Check that every consumer reads its part of a shard in the shard's permutation order
    (ascending positions; with ``one_block`` one contiguous block, as in a run without resumes), and
    put all parts back in position order: the shard's order as all the runs together read it."""
    placed: dict[int, list[tuple[int, int]]] = {}
    for pairs in reads.values():
        by_shard: dict[int, list[int]] = {}
        for shard, index in pairs:
            by_shard.setdefault(shard, []).append(index)
        for shard, got in by_shard.items():
            position = {index: p for p, index in enumerate(perms[shard])}
            at = [position[i] for i in got]
            assert at == sorted(at), f"shard {shard}: a consumer read out of the permutation order"
            if one_block:
                assert at == list(range(at[0], at[0] + len(at))), f"shard {shard}: not one block"
            placed.setdefault(shard, []).extend(zip(at, got))
    return {s: [i for _p, i in sorted(pairs)] for s, pairs in placed.items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    before=st.tuples(st.integers(1, 3), st.integers(0, 3)),
    after=st.tuples(st.integers(1, 3), st.integers(0, 3)),
    epoch=st.integers(0, 3),
    chunking=st.integers(0, 2**32),
)
def test_resumed_run_continues_each_shards_order_on_any_topology(sizes, before, after, epoch, chunking) -> None:
    shards = [ShardSpec(f"s{i}", n) for i, n in enumerate(sizes)]
    perms = {
        i: ShardPermutation(5, epoch, s.name, s.num_samples).indices(0, s.num_samples).tolist()
        for i, s in enumerate(shards)
    }

    uninterrupted: dict = {}
    ts = make_trackers(shards, 2, 2)
    for t in ts:
        t.start_epoch(epoch)
    run(ts, None, uninterrupted, "whole")
    assert ts[0].epoch_done([t.local_state() for t in ts])  # and the exactly-once check passed

    reads: dict = {}
    first = make_trackers(shards, *before)
    for t in first:
        t.start_epoch(epoch)
    run(first, random.Random(chunking), reads, "first")
    state = json.loads(json.dumps(first[0].global_state([t.local_state() for t in first])))
    assert state["shuffle_within_shard"] is True
    second = make_trackers(shards, *after)
    for t in second:
        t.load_global_state(state)
    run(second, None, reads, "second")
    assert second[0].epoch_done([t.local_state() for t in second])

    expected = Counter((i, k) for i, s in enumerate(shards) for k in range(s.num_samples))
    assert Counter(p for pairs in reads.values() for p in pairs) == expected
    whole = per_shard_order(uninterrupted, perms, one_block=True)
    assert per_shard_order(reads, perms) == whole == {i: p for i, p in perms.items() if p}


def test_sample_indices_without_shuffle_are_the_positions() -> None:
    t = DataTracker([ShardSpec("a", 10)])
    assert t.sample_indices(Interval(0, 3, 7)).tolist() == [3, 4, 5, 6]
    s = DataTracker([ShardSpec("a", 10)], shuffle_within_shard=True)
    assert s.sample_indices(Interval(0, 0, 10)).tolist() == ShardPermutation(0, 0, "a", 10).indices(0, 10).tolist()


def test_checkpoint_setting_replaces_the_configured_one(caplog) -> None:
    shards = [ShardSpec("a", 10), ShardSpec("b", 6)]
    t = DataTracker(shards, shuffle_within_shard=True)
    t.record(0, 4)
    state = t.global_state([t.local_state()])
    plain = DataTracker(shards)
    with caplog.at_level("WARNING"):
        plain.load_global_state(state)
    assert (
        plain.config.shuffle_within_shard and "shuffle_within_shard=True replaces the configured False" in caplog.text
    )
    # Shuffled and unshuffled ranks cut different work: their progress is never merged.
    other = DataTracker(shards, world_size=2, rank=1)
    mine = DataTracker(shards, world_size=2, rank=0, shuffle_within_shard=True)
    assert other.assignment_id != mine.assignment_id
