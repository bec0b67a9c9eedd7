"""The exactly-once digest: order-independent hashing of sample identities, merged across workers,
ranks and resumes, and the end-of-epoch check that fires on a planted skip or repeat (here through
tampered states and records; through real DataLoader workers and a faulty reader:
tests/integration/test_data_exactly_once.py)."""

from __future__ import annotations

import copy
import json
import logging
import random

import numpy as np
import pytest

from uc_checkpoint.data.digest import SampleDigest, ShardHasher, check_digest, sample_hashes, shard_keys
from uc_checkpoint.data.intervals import ShardSpec
from uc_checkpoint.data.tracker import DataTracker
from uc_checkpoint.errors import DataLoadingError, ExactlyOnceError

SHARDS = [ShardSpec(f"part-{i}", n) for i, n in enumerate([12, 0, 9, 20])]
SIZES = [s.num_samples for s in SHARDS]
LOGGER = "uc_checkpoint.data.digest"


def hasher() -> ShardHasher:
    return ShardHasher([s.name for s in SHARDS])


def ids(pairs) -> list[int]:
    """``(shard, index)`` pairs as the flat ``[shard, index, ...]`` list a worker sends."""
    return [v for pair in pairs for v in pair]


def test_hash_sums_ignore_order_and_chunking() -> None:
    keys = shard_keys("part-3")
    idx = np.arange(300_000, dtype=np.int64)  # more than one vectorised chunk
    shuffled = idx.copy()
    np.random.default_rng(0).shuffle(shuffled)
    assert sample_hashes(keys, idx) == sample_hashes(keys, shuffled)
    a1, a2 = sample_hashes(keys, idx[:1000])
    b1, b2 = sample_hashes(keys, idx[1000:])
    assert sample_hashes(keys, idx) == ((a1 + b1) % 2**64, (a2 + b2) % 2**64)
    assert sample_hashes(keys, idx[:10]) != sample_hashes(shard_keys("part-2"), idx[:10])  # keyed by shard


def test_digest_merges_commute_and_round_trip() -> None:
    h = hasher()
    pairs = [(s, i) for s, n in enumerate(SIZES) for i in range(n)]
    random.Random(1).shuffle(pairs)
    whole = h.digest_of(ids(pairs))
    parts = [h.digest_of(ids(pairs[i : i + 7])) for i in range(0, len(pairs), 7)]  # batches of workers
    merged = SampleDigest()
    for part in reversed(parts):
        merged.merge(part)
    assert merged == whole and merged.count() == sum(SIZES)
    assert SampleDigest.from_list(json.loads(json.dumps(whole.to_list())), len(SHARDS), "digest") == whole
    assert check_digest(h, SIZES, whole).ok
    report = check_digest(h, SIZES, whole)
    assert report.shards_complete == 4 and report.samples_covered == sum(SIZES)


def test_check_names_skips_repeats_and_swaps() -> None:
    h = hasher()
    every = [(s, i) for s, n in enumerate(SIZES) for i in range(n)]
    skipped = [p for p in every if p != (0, 5)]
    report = check_digest(h, SIZES, h.digest_of(ids(skipped)))
    assert not report.ok and "1 samples skipped and 0 repeated" in report.describe()
    assert "shard 0 'part-0': 1 skipped (11 of 12 consumed)" in report.describe()
    repeated = every + [(3, 19), (3, 19)]
    assert (
        "shard 3 'part-3': 2 repeated (22 consumed of 20)"
        in check_digest(h, SIZES, h.digest_of(ids(repeated))).describe()
    )
    swapped = [p for p in every if p != (2, 4)] + [(2, 8)]  # same count, another sample twice
    text = check_digest(h, SIZES, h.digest_of(ids(swapped))).describe()
    assert "k >= 1 skipped and as many repeated" in text and "part-2" in text and "part-0" not in text


def test_check_so_far_subtracts_the_remaining_samples() -> None:
    h = hasher()
    consumed = [(0, i) for i in range(12) if i not in (3, 4)]
    remaining = {0: [np.array([3, 4])], 2: [np.arange(9)], 3: [np.arange(20)]}
    assert check_digest(h, SIZES, h.digest_of(ids(consumed)), remaining).ok
    assert not check_digest(h, SIZES, h.digest_of(ids(consumed + [(0, 0)])), remaining).ok


def finished_epoch(**kw) -> DataTracker:
    t = DataTracker(SHARDS, num_workers=2, **kw)
    for w in range(2):
        t.record(w, t.samples_left(w))
    return t


def test_a_normal_epoch_passes_at_epoch_done_and_at_the_next_start_epoch(caplog) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert finished_epoch().epoch_done()
    assert "epoch 0 exactly-once check passed: all 41 samples of 4 shards consumed exactly once" in caplog.text
    t = finished_epoch()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        t.start_epoch(1)  # the world-size-1 tracker checks the epoch it leaves
    assert "epoch 0 exactly-once check passed" in caplog.text


def tampered_resume(change, **kw) -> DataTracker:
    """Save half an epoch, tamper with the state, resume on 2 ranks x 3 workers and finish."""
    t = DataTracker(SHARDS, seed=4, num_workers=1)
    t.record(0, 17)
    state = json.loads(json.dumps(t.global_state([t.local_state()])))
    change(state)
    ranks = [DataTracker(SHARDS, rank=r, world_size=2, num_workers=3, **kw) for r in range(2)]
    for r in ranks:
        r.load_global_state(copy.deepcopy(state))
        for w in range(3):
            r.record(w, r.samples_left(w))
    return ranks[0], [r.local_state() for r in ranks]


def test_an_interrupted_epoch_resumed_on_another_topology_passes() -> None:
    tracker, gathered = tampered_resume(lambda s: None)
    assert tracker.epoch_done(gathered)
    state = tracker.global_state(gathered)
    assert state["remaining"] == [] and sum(c for _s, c, _h in state["digest"]) == 41


def shift_first_interval(state: dict) -> None:
    # Remaining work moved one sample to the left: one consumed sample read again, the last one never.
    # Counts still add up, so only the digest can tell.
    shard, start, end = state["remaining"][0]
    assert start > 0
    state["remaining"][0] = [shard, start - 1, end - 1]


def test_a_tampered_state_raises_at_the_epoch_end_naming_the_shard() -> None:
    tracker, gathered = tampered_resume(shift_first_interval)
    with pytest.raises(ExactlyOnceError, match="k >= 1 skipped and as many repeated") as exc:
        tracker.epoch_done(gathered)
    assert isinstance(exc.value, DataLoadingError) and "epoch 0" in str(exc.value)
    assert tracker.epoch_done(gathered)  # checked once; the caller decided to go on


def test_a_tampered_digest_names_the_repeat(caplog) -> None:
    def count_one_more(state: dict) -> None:
        shard, count, _hash = state["digest"][0]
        state["digest"][0] = [shard, count + 1, "0" * 32]
        state["samples_consumed_in_epoch"] += 1
        shard, start, end = state["remaining"][-1]
        state["remaining"][-1] = [shard, start, end - 1]

    tracker, gathered = tampered_resume(count_one_more, exactly_once="warn")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert tracker.epoch_done(gathered)  # warns, does not raise
    assert "exactly-once check of epoch 0 failed" in caplog.text and "repeated" in caplog.text
    assert "skipped" in caplog.text  # the last sample of the shortened interval was never read


def test_records_that_misattribute_samples_fire() -> None:
    """A loader of one's own that hands worker 0's samples out as worker 1's too: the counts are
    right, the digest is not."""
    t = DataTracker(SHARDS, num_workers=2)
    h = hasher()
    slices = [[(iv.shard, int(i)) for iv in t.consumer_slices(w) for i in t.sample_indices(iv)] for w in range(2)]
    t.record(0, len(slices[0]), h.digest_of(ids(slices[0])))
    wrong = (slices[0] * 2)[: len(slices[1])]
    t.record(1, len(slices[1]), h.digest_of(ids(wrong)))
    with pytest.raises(ExactlyOnceError, match="skipped"):
        t.epoch_done()


def test_a_digest_for_another_count_is_refused() -> None:
    t = DataTracker(SHARDS)
    with pytest.raises(ValueError, match="a digest of 1 samples was recorded for 2 samples"):
        t.record(0, 2, hasher().digest_of(ids([(0, 0)])))


def test_off_computes_nothing_and_checks_nothing() -> None:
    t = DataTracker(SHARDS, exactly_once="off")
    t.record(0, 5, hasher().digest_of(ids([(0, 0)])))  # not even looked at
    assert t.local_state()["digest"] is None
    t.record(0, t.samples_left(0))
    assert t.epoch_done() and t.global_state([t.local_state()])["digest"] is None
    with pytest.raises(ValueError, match="exactly_once must be one of"):
        DataTracker(SHARDS, exactly_once="sometimes")


def test_abandoned_and_changed_epochs_are_not_checked(caplog) -> None:
    t = DataTracker(SHARDS, num_workers=1)
    t.record(0, 3)
    t.start_epoch(1)  # leaves samples unread: nothing to check, nothing raised
    t.record(0, 10)
    state = t.global_state([t.local_state()])
    changed = [SHARDS[0], SHARDS[1], ShardSpec("part-2", 10), SHARDS[3]]  # part-2 grew
    r = DataTracker(changed, allow_dataset_change=True)
    r.load_global_state(state)
    r.record(0, r.samples_left())
    with caplog.at_level(logging.INFO):
        assert r.epoch_done()
    assert "epoch 1 is not checked for exactly-once" in caplog.text
