"""The data-pipeline tracker: exactly once per epoch across resumes that change ranks and workers.

No torch here: the tracker is pure Python and the package imports torch only when a name that needs
it is first used.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import uc_checkpoint.data.tracker as dt

DataTracker = dt.DataTracker
DatasetMismatchError = dt.DatasetMismatchError
Interval = dt.Interval
ShardSpec = dt.ShardSpec
assign = dt.assign
dataset_fingerprint = dt.dataset_fingerprint
epoch_shard_order = dt.epoch_shard_order
iter_positions = dt.iter_positions

LOGGER = dt.logger.name


def make_shards(sizes: list[int], prefix: str = "shard") -> list:
    return [ShardSpec(f"{prefix}-{i:03d}", n) for i, n in enumerate(sizes)]


def make_trackers(shards, *, world: int, nw: int, seed: int = 0, **kw) -> list:
    return [DataTracker(shards, seed=seed, rank=r, world_size=world, num_workers=nw, **kw) for r in range(world)]


def gather(trackers) -> list[dict]:
    # What all_gather_object would hand every rank; JSON round trip proves the local states are plain.
    return json.loads(json.dumps([t.local_state() for t in trackers]))


def save(trackers) -> dict:
    """Global state as every rank computes it; all ranks must agree."""
    locals_ = gather(trackers)
    states = [t.global_state(locals_) for t in trackers]
    for s in states[1:]:
        assert s == states[0]
    state = states[0]
    assert json.loads(json.dumps(state)) == state
    return state


def whole_epoch(shards, epoch: int) -> Counter:
    return Counter((epoch, i, k) for i, s in enumerate(shards) for k in range(s.num_samples))


def consume(tracker, worker: int, count: int, rnd: random.Random, epoch_log: list) -> None:
    """Consumer ``worker`` of ``tracker`` reads and consumes its next ``count`` samples, recording them
    in random chunks and checking position() along the way."""
    todo = list(iter_positions(tracker.consumer_slices(worker)))[:count]
    assert len(todo) == count
    done = 0
    while done < count:
        assert tracker.position(worker) == todo[done]
        chunk = rnd.randint(1, count - done)
        tracker.record(worker, chunk)
        epoch_log.extend((tracker.epoch, s, k) for s, k in todo[done : done + chunk])
        done += chunk
    if tracker.samples_left(worker) == 0:
        assert tracker.position(worker) is None


sizes_st = st.lists(st.integers(0, 40), min_size=1, max_size=12)
topology_st = st.tuples(st.integers(1, 4), st.integers(0, 4))  # (world_size, num_workers)


# ---------------------------------------------------------------------------------------------------
# The main property: interrupted and resumed runs consume exactly one epoch's samples, once each.
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=sizes_st, seed=st.integers(-(2**40), 2**40), data=st.data())
def test_exactly_once_across_resumes_and_topology_changes(sizes, seed, data):
    shards = make_shards(sizes)
    rnd = random.Random(data.draw(st.integers(0, 2**32), label="chunking seed"))
    first_epoch = data.draw(st.integers(0, 3), label="first epoch")
    crashes = data.draw(st.integers(1, 4), label="interrupted runs")
    committed: list = []  # (epoch, shard, sample) covered by the checkpoint the next run loads
    state: dict | None = None

    for run in range(crashes + 1):
        final = run == crashes
        world, nw = data.draw(topology_st, label=f"run {run} topology")
        trackers = make_trackers(shards, world=world, nw=nw, seed=seed)
        if state is None:
            for t in trackers:
                t.start_epoch(first_epoch)
        else:
            for t in trackers:
                t.load_global_state(state)
                assert t.epoch == state["epoch"]
            if data.draw(st.booleans(), label="loop idiom start_epoch(epoch)"):
                for t in trackers:
                    t.start_epoch(t.epoch)  # first call after a load keeps the restored work
            # Saving right after a resume reproduces the loaded state (modulo the optional shard list),
            # the consumer layout included when this run has the saving run's topology; another
            # topology cuts the work evenly, worker 0 first, which a state does not spell out.
            expected = dict(state)
            layout = state.get("consumers")
            if layout is not None and (layout["world_size"], layout["workers_per_rank"]) != (world, max(nw, 1)):
                del expected["consumers"]
            assert save(trackers) == expected

        log: list = []  # consumed in this run
        saved_upto = 0  # len(log) at the last save of this run
        saved_state = None
        rounds = 1 if final else data.draw(st.integers(1, 3), label="rounds")
        for _ in range(rounds):
            if trackers[0].epoch_done(gather(trackers)) and not final:
                if data.draw(st.booleans(), label="advance epoch"):
                    nxt = trackers[0].epoch + 1
                    for t in trackers:
                        t.start_epoch(nxt)
            for t in trackers:
                for w in range(t.config.workers_per_rank):
                    left = t.samples_left(w)
                    # Seeded Random rather than one draw per consumer: hypothesis draws are the
                    # bulk of this test's cost on a slow machine.
                    k = left if final else rnd.choice([left, 0, rnd.randint(0, left)])
                    consume(t, w, k, rnd, log)
            if final or data.draw(st.booleans(), label="save"):
                saved_state = save(trackers)
                saved_upto = len(log)
                e = saved_state["epoch"]
                # The state's consumed count covers every run that fed this checkpoint.
                assert saved_state["samples_consumed_in_epoch"] == sum(1 for x in committed + log if x[0] == e)
                assert (saved_state["remaining"] == []) == trackers[0].epoch_done(gather(trackers))
        # Crash (or end): what was consumed after the last save is lost with the model updates.
        if saved_state is not None:
            committed.extend(log[:saved_upto])
            state = saved_state
        if final:
            assert saved_state["remaining"] == []

    per_epoch: dict[int, Counter] = {}
    for item in committed:
        per_epoch.setdefault(item[0], Counter())[item] += 1
    last = state["epoch"]
    assert max(per_epoch, default=last) <= last
    for e in range(first_epoch, last + 1):
        assert per_epoch.get(e, Counter()) == whole_epoch(shards, e), f"epoch {e}"


@settings(max_examples=100, deadline=None)
@given(sizes=sizes_st, topo=topology_st, seed=st.integers(0, 1000), epoch=st.integers(0, 5), data=st.data())
def test_lockstep_resume_with_same_topology_gives_each_consumer_the_rest_of_its_slice(sizes, topo, seed, epoch, data):
    world, nw = topo
    shards = make_shards(sizes)
    before = make_trackers(shards, world=world, nw=nw, seed=seed)
    for t in before:
        t.start_epoch(epoch)
    k = data.draw(st.integers(0, min(t.samples_left(w) for t in before for w in range(t.config.workers_per_rank))))
    for t in before:
        for w in range(t.config.workers_per_rank):
            t.record(w, k)
    state = save(before)
    after = make_trackers(shards, world=world, nw=nw, seed=seed)
    for t in after:
        t.load_global_state(state)
    for b, a in zip(before, after):
        for w in range(b.config.workers_per_rank):
            assert a.consumer_slices(w) == b.consumer_slices(w)


# ---------------------------------------------------------------------------------------------------
# assign() and the stream
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    raw=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 50), st.integers(0, 30)), max_size=15),
    n=st.integers(1, 20),
)
def test_assign_balanced_contiguous_and_complete(raw, n):
    remaining = [Interval(s, a, a + ln) for s, a, ln in raw]
    slices = assign(remaining, n)
    assert len(slices) == n
    sizes = [sum(iv.size for iv in sl) for sl in slices]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra samples go to the first consumers
    assert all(iv.size > 0 for sl in slices for iv in sl)
    # Concatenated in consumer order the slices are the input stream, so each is a contiguous piece.
    assert [p for sl in slices for p in iter_positions(sl)] == list(iter_positions(remaining))


def test_assign_examples():
    assert assign([Interval(3, 0, 5), Interval(1, 2, 4)], 3) == [
        [Interval(3, 0, 3)],
        [Interval(3, 3, 5)],
        [Interval(1, 2, 4)],
    ]
    # A slice may span shards and start mid-shard.
    assert assign([Interval(0, 0, 3), Interval(1, 0, 3)], 2) == [
        [Interval(0, 0, 3)],
        [Interval(1, 0, 3)],
    ]
    assert assign([Interval(0, 0, 4), Interval(1, 0, 3)], 2) == [
        [Interval(0, 0, 4)],
        [Interval(1, 0, 3)],
    ]
    assert assign([Interval(0, 0, 2), Interval(1, 0, 3)], 2) == [
        [Interval(0, 0, 2), Interval(1, 0, 1)],
        [Interval(1, 1, 3)],
    ]
    assert assign([Interval(0, 0, 1)], 3) == [[Interval(0, 0, 1)], [], []]
    assert assign([], 2) == [[], []]
    with pytest.raises(ValueError):
        assign([], 0)


@settings(max_examples=100, deadline=None)
@given(sizes=sizes_st, topo=topology_st, seed=st.integers(), epoch=st.integers(0, 50))
def test_consumers_in_order_read_the_epoch_stream(sizes, topo, seed, epoch):
    world, nw = topo
    shards = make_shards(sizes)
    trackers = make_trackers(shards, world=world, nw=nw, seed=seed)
    for t in trackers:
        t.start_epoch(epoch)
    stream = [(i, k) for i in epoch_shard_order(len(shards), seed, epoch) for k in range(sizes[i])]
    read = [p for t in trackers for w in range(t.config.workers_per_rank) for p in iter_positions(t.consumer_slices(w))]
    assert read == stream
    # Consumer numbering: rank * workers_per_rank + worker.
    assert [t.consumer_id(w) for t in trackers for w in range(t.config.workers_per_rank)] == list(
        range(world * max(1, nw))
    )


# ---------------------------------------------------------------------------------------------------
# Epoch order and fingerprint
# ---------------------------------------------------------------------------------------------------


def test_epoch_order_is_deterministic_permutation_and_changes_with_epoch_and_seed():
    order = epoch_shard_order(12, 7, 3)
    assert order == epoch_shard_order(12, 7, 3)
    assert sorted(order) == list(range(12))
    by_epoch = {tuple(epoch_shard_order(12, 7, e)) for e in range(10)}
    assert len(by_epoch) == 10
    assert epoch_shard_order(12, 8, 3) != order
    assert epoch_shard_order(0, 1, 1) == []
    assert epoch_shard_order(1, 1, 1) == [0]


def test_epoch_order_is_pinned():
    # Resumed runs rebuild the order from (seed, epoch): changing the algorithm breaks old checkpoints.
    assert epoch_shard_order(10, 0, 0) == PINNED_ORDER_10_0_0
    assert epoch_shard_order(10, 1234, 5) == PINNED_ORDER_10_1234_5


PINNED_ORDER_10_0_0 = [5, 3, 8, 6, 2, 9, 4, 7, 1, 0]
PINNED_ORDER_10_1234_5 = [2, 9, 0, 8, 6, 5, 1, 7, 4, 3]


def test_fingerprint_is_order_name_and_size_sensitive():
    base = [ShardSpec("a", 1), ShardSpec("b", 2)]
    fp = dataset_fingerprint(base)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert dataset_fingerprint(list(base)) == fp
    assert dataset_fingerprint(base[::-1]) != fp
    assert dataset_fingerprint([ShardSpec("a", 1), ShardSpec("b", 3)]) != fp
    assert dataset_fingerprint([ShardSpec("a", 1), ShardSpec("c", 2)]) != fp
    assert dataset_fingerprint(base + [ShardSpec("c", 0)]) != fp
    # Length prefixes: names and counts cannot run into each other.
    assert dataset_fingerprint([ShardSpec("a:1", 2)]) != dataset_fingerprint([ShardSpec("a", 12)])
    assert dataset_fingerprint([ShardSpec("ab", 1)]) != dataset_fingerprint([ShardSpec("a", 1), ShardSpec("b", 1)])
    # Names may hold any character, separators included; without length prefixes these two would collide.
    assert dataset_fingerprint([ShardSpec("a:1\nb", 2), ShardSpec("c", 3)]) != dataset_fingerprint(
        [ShardSpec("a", 1), ShardSpec("b:2\nc", 3)]
    )


def test_shard_and_interval_validation():
    with pytest.raises(ValueError):
        ShardSpec("a", -1)
    with pytest.raises(TypeError):
        ShardSpec("a", 1.0)
    with pytest.raises(TypeError):
        ShardSpec("a", True)
    with pytest.raises(ValueError):
        Interval(0, 5, 4)
    with pytest.raises(ValueError):
        DataTracker([])
    with pytest.raises(ValueError):
        DataTracker(make_shards([1]), rank=2, world_size=2)


# ---------------------------------------------------------------------------------------------------
# Dataset changes and bad states
# ---------------------------------------------------------------------------------------------------


def _half_consumed_state(shards, **kw) -> dict:
    t = DataTracker(shards, seed=3)
    t.record(0, t.samples_left() // 2)
    return t.global_state([t.local_state()], **kw)


def test_fingerprint_mismatch_names_the_difference():
    old = make_shards([10, 20, 30])
    state = _half_consumed_state(old)

    resized = [old[0], ShardSpec(old[1].name, 21), old[2]]
    with pytest.raises(DatasetMismatchError) as exc:
        DataTracker(resized, seed=3).load_global_state(state)
    msg = str(exc.value)
    assert "shard 1" in msg and "shard-001" in msg and "20 samples" in msg and "21 samples" in msg
    assert isinstance(exc.value, ValueError)

    grown = old + [ShardSpec("new", 5)]
    with pytest.raises(DatasetMismatchError, match=r"number of shards: checkpoint 3, now 4") as exc:
        DataTracker(grown, seed=3).load_global_state(state)
    assert "'new' (5 samples)" in str(exc.value)

    no_list = _half_consumed_state(old, include_shard_list=False)
    assert "shards" not in no_list
    with pytest.raises(DatasetMismatchError, match="same number of shards"):
        DataTracker(resized, seed=3).load_global_state(no_list)


def test_allow_dataset_change_names_what_it_cannot_carry_and_drops_only_when_asked(caplog):
    old = [ShardSpec("a", 10), ShardSpec("b", 10), ShardSpec("c", 10)]
    t = DataTracker(old, seed=0)
    state = t.global_state([t.local_state()])  # nothing consumed yet
    # "b" removed, "c" shrunk to 4, "a" moved to the end, "d" added.
    new = [ShardSpec("c", 4), ShardSpec("d", 7), ShardSpec("a", 10)]
    refusing = DataTracker(new, seed=0, allow_dataset_change=True)
    with pytest.raises(DatasetMismatchError) as exc:
        refusing.load_global_state(state)
    msg = str(exc.value)
    assert "16 unread samples of epoch 0 cannot be carried over" in msg
    assert "'b': 10 unread samples (the shard is gone: removed or renamed)" in msg
    assert "'c': 6 unread samples (the shard has 4 samples now)" in msg and "drop_unmapped=True" in msg
    assert refusing.load_count == 0 and refusing.dataset_change is None  # nothing changed
    with pytest.raises(ValueError, match="needs allow_dataset_change=True"):
        DataTracker(new, drop_unmapped=True)

    loaded = DataTracker(new, seed=0, allow_dataset_change=True, drop_unmapped=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded.load_global_state(state)
    change = loaded.dataset_change
    assert change is not None and change.dropped == 16 and change.carried == 14
    assert [(u.name, u.samples) for u in change.unmapped] == [("b", 10), ("c", 6)]
    assert change.added == ("d",)
    assert any(
        "dataset changed" in r.getMessage() and "'b': 10 unread samples" in r.getMessage() for r in caplog.records
    )
    got = sorted(iter_positions(loaded.consumer_slices(0)))
    assert got == sorted([(0, k) for k in range(4)] + [(2, k) for k in range(10)])
    # The next epoch reads the whole new dataset.
    loaded.record(0, loaded.samples_left())
    assert loaded.epoch_done()
    loaded.start_epoch(1)
    assert sorted(iter_positions(loaded.consumer_slices(0))) == sorted(
        (i, k) for i, s in enumerate(new) for k in range(s.num_samples)
    )

    # Without a shard list intervals are mapped by index.
    state_nolist = t.global_state([t.local_state()], include_shard_list=False)
    by_index = DataTracker([ShardSpec("x", 3), ShardSpec("y", 20)], seed=0, allow_dataset_change=True)
    with pytest.raises(DatasetMismatchError, match="'#0': 7 unread samples"):
        by_index.load_global_state(state_nolist)
    by_index = DataTracker(
        [ShardSpec("x", 3), ShardSpec("y", 20)], seed=0, allow_dataset_change=True, drop_unmapped=True
    )
    by_index.load_global_state(state_nolist)
    assert sorted(iter_positions(by_index.consumer_slices(0))) == sorted(
        [(0, k) for k in range(3)] + [(1, k) for k in range(10)]
    )


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s.update(format=1), "format 1"),
        (lambda s: s.pop("format"), "format None"),
        (lambda s: s.pop("remaining"), "lacks"),
        (lambda s: s.update(remaining=[[0, 0, 5], [0, 3, 6]]), "overlap"),
        (lambda s: s.update(remaining=[[9, 0, 1]]), "shard 9"),
        (lambda s: s.update(remaining=[[0, 0, 99]]), "exceeds"),
        (lambda s: s.update(remaining=[[0, 2, 1]]), "bad remaining"),
        (lambda s: s.update(samples_consumed_in_epoch=s["samples_consumed_in_epoch"] + 1), "inconsistent"),
        (lambda s: s.update(samples_consumed_in_epoch=s["samples_consumed_in_epoch"] + 1, digest=None), "inconsistent"),
    ],
)
def test_bad_states_are_rejected(mutate, match):
    shards = make_shards([10, 10])
    state = _half_consumed_state(shards)
    DataTracker(shards, seed=3).load_global_state(json.loads(json.dumps(state)))  # the unmutated one loads
    mutate(state)
    with pytest.raises(ValueError, match=match):
        DataTracker(shards, seed=3).load_global_state(state)


# ---------------------------------------------------------------------------------------------------
# State size, JSON, epochs, uneven ends
# ---------------------------------------------------------------------------------------------------


def _state_after_partial_epoch(per_shard: int, **kw) -> dict:
    shards = make_shards([per_shard] * 6)
    trackers = make_trackers(shards, world=3, nw=2, seed=1, **kw)
    for t in trackers:
        for w in range(t.config.workers_per_rank):
            t.record(w, t.samples_left(w) * (w + 1) // 3)  # uneven progress: 1/3 and 2/3 of each slice
    return save(trackers)


def test_state_size_does_not_grow_with_samples():
    # The digest of what was consumed is one entry per shard touched, whatever the samples.
    assert len(_state_after_partial_epoch(1_000)["digest"]) <= 6
    # Without it (recording a billion samples at once would hash them all), the rest of the state:
    small = _state_after_partial_epoch(1_000, exactly_once="off")
    huge = _state_after_partial_epoch(1_000_000_000, exactly_once="off")
    assert len(small["remaining"]) == len(huge["remaining"])
    assert len(huge["remaining"]) <= 6 + 3 * 2  # shards + consumers
    # Same structure; only the digits of the numbers differ.
    assert abs(len(json.dumps(huge)) - len(json.dumps(small))) <= 8 * (3 * len(huge["remaining"]) + 10)
    assert len(json.dumps(huge)) < 1500
    # Cutting work into slices must not fragment the state: untouched work is one interval per shard.
    fresh = make_trackers(make_shards([1_000_000_000] * 6), world=4, nw=0, seed=1)  # slices end mid-shard
    assert len(save(fresh)["remaining"]) == 6
    # And loading it is just as cheap (no per-sample work): resharded to 4 ranks x 3 workers.
    t = DataTracker(make_shards([1_000_000_000] * 6), seed=1, rank=3, world_size=4, num_workers=3)
    t.load_global_state(huge)
    assert t.samples_left() > 0


def test_state_is_plain_json():
    state = _state_after_partial_epoch(50)

    def plain(x) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return type(x) in (int, str, bool) or x is None

    assert plain(state)
    assert set(state) == {
        "format",
        "fingerprint",
        "seed",
        "epoch",
        "shuffle_within_shard",
        "remaining",
        "samples_consumed_in_epoch",
        "num_shards",
        "digest",
        "shards",
        "consumers",  # uneven progress: the cut and each rank's next worker
    }
    assert json.loads(json.dumps(state)) == state


def test_epoch_boundary_resume_and_next_epoch():
    shards = make_shards([3, 0, 5])
    t = DataTracker(shards, seed=9, world_size=1, num_workers=2)
    t.start_epoch(4)
    for w in range(2):
        t.record(w, t.samples_left(w))
    assert t.rank_exhausted() and t.epoch_done()
    state = t.global_state([t.local_state()])
    assert state["remaining"] == [] and state["samples_consumed_in_epoch"] == 8 and state["epoch"] == 4

    r = DataTracker(shards, seed=9, world_size=1, num_workers=0)
    r.load_global_state(state)
    assert r.epoch == 4 and r.epoch_done() and r.consumer_slices(0) == []
    r.start_epoch(4)  # loop idiom right after the load: still the finished epoch
    assert r.epoch_done()
    r.start_epoch(5)
    assert not r.epoch_done() and r.samples_left() == 8
    assert [iv.shard for iv in r.consumer_slices(0)] == [i for i in epoch_shard_order(3, 9, 5) if i != 1]


def test_start_epoch_after_load_keeps_restored_work_only_once(caplog):
    shards = make_shards([6, 6])
    t = DataTracker(shards)
    t.record(0, 4)
    state = t.global_state([t.local_state()])
    r = DataTracker(shards)
    r.load_global_state(state)
    r.start_epoch(0)
    assert r.samples_left() == 8
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        r.start_epoch(0)  # an explicit restart of the epoch later on does restart it
    assert r.samples_left() == 12
    assert any("leaving 8 samples of epoch 0 unread" in rec.getMessage() for rec in caplog.records)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        r2 = DataTracker(shards)
        r2.load_global_state(state)
        r2.start_epoch(1)  # a different epoch abandons the restored one, with a warning
    assert r2.epoch == 1 and r2.samples_left() == 12
    assert any("leaving 8 samples of epoch 0 unread" in rec.getMessage() for rec in caplog.records)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        DataTracker(shards).start_epoch(3)  # skipping an untouched fresh epoch loses nothing: quiet
    assert not caplog.records


def test_uneven_end_one_rank_runs_dry_first(caplog):
    shards = make_shards([5])
    ranks = make_trackers(shards, world=2, nw=0)
    assert [t.samples_left() for t in ranks] == [3, 2]
    for t in ranks:
        t.record(0, 2)
    assert [t.rank_exhausted() for t in ranks] == [False, True]
    assert ranks[1].consumer_slices(0) == [] and ranks[1].position(0) is None
    assert not ranks[0].epoch_done(gather(ranks))
    with pytest.raises(ValueError, match="gathered"):
        ranks[0].epoch_done()
    assert save(ranks)["remaining"] == [[0, 2, 3]]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ranks[0].start_epoch(1)
    assert any("leaving 1 samples" in r.getMessage() for r in caplog.records)


def test_record_rejects_overconsumption_and_bad_workers():
    t = DataTracker(make_shards([4]), world_size=2, rank=1, num_workers=0)
    assert t.samples_left() == 2
    t.record(0, 2)
    with pytest.raises(ValueError, match="only 0 samples"):
        t.record(0)
    with pytest.raises(ValueError, match="worker 1"):
        t.record(1)
    with pytest.raises(ValueError):
        t.record(0, -1)
    with pytest.raises(ValueError):
        DataTracker(make_shards([4]), num_workers=2).consumer_slices(2)


def test_global_state_rejects_inconsistent_local_states():
    shards = make_shards([10, 10])
    ranks = make_trackers(shards, world=2, nw=2)
    locals_ = gather(ranks)
    with pytest.raises(ValueError, match="all 2 ranks"):
        ranks[0].global_state(locals_[:1])
    with pytest.raises(ValueError, match="two local states"):
        ranks[0].global_state([locals_[0], locals_[0]])
    ranks[1].start_epoch(1)
    with pytest.raises(ValueError, match="epoch"):
        ranks[0].global_state(gather(ranks))
    other = make_trackers(shards, world=2, nw=3)
    with pytest.raises(ValueError):
        ranks[0].global_state(gather(other))
    bad = gather(make_trackers(shards, world=2, nw=2))
    bad[1]["consumed"][0] = 10**6
    with pytest.raises(ValueError, match="consumed"):
        make_trackers(shards, world=2, nw=2)[0].global_state(bad)


def test_seed_comes_from_the_checkpoint(caplog):
    shards = make_shards([1] * 8)
    t = DataTracker(shards, seed=5)
    t.record(0, 3)
    state = t.global_state([t.local_state()])
    r = DataTracker(shards, seed=6)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        r.load_global_state(state)
    assert r.config.seed == 5 and any("seed 5" in rec.getMessage() for rec in caplog.records)
    r.record(0, r.samples_left())
    r.start_epoch(1)
    assert [iv.shard for iv in r.consumer_slices(0)] == epoch_shard_order(8, 5, 1)


def test_resume_summary_names_skipped_shards_and_seeks():
    shards = make_shards([10, 10, 10, 10])
    trackers = make_trackers(shards, world=2, nw=1)
    # Stream order of epoch 0; each rank's slice is 20 samples = two whole shards.
    order = [iv.shard for t in trackers for iv in t.consumer_slices(0)]
    trackers[0].record(0, 13)  # rank 0: its first shard done, 3 into its second
    trackers[1].record(0, 4)
    state = save(trackers)
    r = DataTracker(shards, world_size=1)
    r.load_global_state(state)
    s = r.resume_summary()
    assert s["skipped_names"] == [shards[order[0]].name] and s["skipped_shards"] == 1
    assert s["samples_consumed_in_epoch"] == 17 and s["samples_remaining"] == 23
    assert sorted(s["partial_shards"]) == sorted([[shards[order[1]].name, 3, 10], [shards[order[2]].name, 4, 10]])
    assert s["seeks"] == [[0, 0, shards[order[1]].name, 3]]  # one consumer now: it starts 3 into shard 2


def test_worker_copy_follows_new_epochs_but_not_loads():
    import copy

    shards = make_shards([5, 7, 3])
    main = DataTracker(shards, num_workers=2)
    worker = copy.deepcopy(main)  # what a persistent DataLoader worker holds
    main.record(1, 2)
    assert worker.sync_from_main_process(main.epoch, main.assignment_id, [0, 2])
    assert worker.consumer_slices(1) == main.consumer_slices(1)
    main.start_epoch(1)
    assert worker.sync_from_main_process(main.epoch, main.assignment_id, [0, 0])
    assert worker.consumer_slices(0) == main.consumer_slices(0) and worker.epoch == 1
    other = DataTracker(shards, num_workers=1)
    other.record(0, 4)
    main.load_global_state(other.global_state([other.local_state()]))
    assert main.work_from_checkpoint
    assert not worker.sync_from_main_process(main.epoch, main.assignment_id, [0, 0])


def _worker_stop_signals(worker_id: int) -> None:
    """A user's worker_init_fn: records that it ran, and whether the stop signals were already left
    to the rank (blocked in the worker's main thread, taken by the rank-aware thread)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os.environ["UC_TEST_WORKER_INIT"] = f"{worker_id}:{int({signal.SIGTERM, signal.SIGINT, signal.SIGHUP} <= blocked)}"


def _init_sample(shard: ShardSpec, start: int, end: int) -> Iterator[tuple[int, str]]:
    for _ in range(start, end):
        yield os.getpid(), os.environ.get("UC_TEST_WORKER_INIT", "")


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="workers keep torch's handlers without sigwaitinfo")
def test_loader_workers_leave_stop_signals_to_the_rank_then_run_the_users_init() -> None:
    """A launcher's SIGTERM to the rank's process group, or a scheduler's to every process, must not
    kill the workers (they would fail the rank before its final checkpoint): they leave the stop
    signals to the rank first, then the user's worker_init_fn runs. (That the signals are then
    survived: tests/integration/test_data_worker_turns.py.)"""
    from uc_checkpoint import TrackedDataLoader, TrackedShardDataset

    tracker = DataTracker([ShardSpec("a", 4), ShardSpec("b", 4)], num_workers=2)
    loader = TrackedDataLoader(
        TrackedShardDataset(tracker, _init_sample),
        batch_size=None,
        num_workers=2,
        worker_init_fn=_worker_stop_signals,
    )
    seen = list(loader)
    assert len(seen) == 8
    for pid, init in seen:
        assert pid != os.getpid()
        assert init in ("0:1", "1:1")
