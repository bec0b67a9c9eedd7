"""uc_checkpoint.data.layout: a state saved with workers mid-turn keeps each consumer's remaining work
and each rank's next worker; the same topology gets both back, another one cuts evenly from worker
0; a malformed layout is a TrackerStateError naming the field. (The batches themselves, with real
DataLoader workers: tests/integration/test_data_worker_turns.py.)"""

from __future__ import annotations

import json
import logging

import pytest

from uc_checkpoint.data.intervals import Interval, cut
from uc_checkpoint.data.layout import ConsumerLayout
from uc_checkpoint.data.state import TrackerState
from uc_checkpoint.data.tracker import DataTracker, ShardSpec
from uc_checkpoint.errors import TrackerStateError

SHARDS = [ShardSpec(f"s{i}", n) for i, n in enumerate([7, 0, 13, 5, 9])]  # 34 samples


def trackers(world: int = 2, workers: int = 2, batch_size: int = 1) -> list[DataTracker]:
    return [
        DataTracker(SHARDS, seed=3, rank=r, world_size=world, num_workers=workers, batch_size=batch_size)
        for r in range(world)
    ]


def save(ts: list[DataTracker]) -> dict:
    gathered = json.loads(json.dumps([t.local_state() for t in ts]))
    return ts[0].global_state(gathered)


def stopped_mid_turn() -> tuple[list[DataTracker], dict]:
    """Two ranks of two workers after three batches of 2 each: workers 0, 1, 0 (rank 0 next: 1)."""
    ts = trackers()
    for t in ts:
        for w in (0, 1, 0):
            t.record(w, 2)
    return ts, save(ts)


def test_a_state_saved_mid_turn_keeps_each_consumers_rest_and_the_next_worker() -> None:
    ts, state = stopped_mid_turn()
    assert ts[0].next_worker == 1
    # Slices of 9, 9, 8, 8 samples (34 over 4 consumers); 4, 2, 4, 2 consumed.
    assert state["consumers"] == {
        "world_size": 2,
        "workers_per_rank": 2,
        "batch_size": 1,
        "remaining": [5, 7, 4, 6],
        "next_worker": [1, 1],
    }
    resumed = trackers()
    for t in resumed:
        t.load_global_state(state)
    for old, new in zip(ts, resumed):
        assert new.next_worker == 1
        for w in (0, 1):
            assert new.consumer_slices(w) == old.consumer_slices(w)  # each consumer's own rest
    assert save(resumed) == state  # saving straight after the resume gives the same state


def test_lock_step_progress_saves_no_layout_and_start_epoch_starts_at_worker_0() -> None:
    ts = trackers()
    for t in ts:
        t.record(0, 2)
        t.record(1, 2)
    assert ts[0].next_worker == 0
    assert "consumers" not in save(ts)  # a fresh cut of the rest is the same cut
    ts[0].record(0, 1)
    assert ts[0].next_worker == 1
    ts[0].start_epoch(1)
    assert ts[0].next_worker == 0


@pytest.mark.parametrize(("world", "workers", "batch_size"), [(2, 3, 1), (1, 2, 1), (4, 1, 1), (2, 2, 2)])
def test_another_topology_cuts_evenly_from_worker_0(
    world: int, workers: int, batch_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    _, state = stopped_mid_turn()
    fresh = trackers(world, workers, batch_size)
    with caplog.at_level(logging.INFO, logger="uc_checkpoint.data.layout"):
        for t in fresh:
            t.load_global_state(state)
    assert "its remaining work is cut evenly, each rank's worker 0 first" in caplog.text
    even = DataTracker(SHARDS, seed=3, rank=0, world_size=world, num_workers=workers, batch_size=batch_size)
    saved = TrackerState.from_dict(state)
    even.load_global_state({k: v for k, v in state.items() if k != "consumers"})
    assert saved.consumers is not None
    for t in fresh:
        assert t.next_worker == 0
    assert [fresh[0].consumer_slices(w) for w in range(max(workers, 1))] == [
        even.consumer_slices(w) for w in range(max(workers, 1))
    ]


def _with_consumers(**change: object) -> dict:
    _, state = stopped_mid_turn()
    state["consumers"] = {**state["consumers"], **change}
    return state


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({**stopped_mid_turn()[1], "consumers": None}, "'consumers' must be a dict with keys"),
        ({**stopped_mid_turn()[1], "consumers": {"world_size": 2}}, "'consumers' must be a dict with keys"),
        (_with_consumers(remaining=[5, 6, 5]), "consumers.remaining must list 4 counts"),
        (_with_consumers(next_worker=[1]), "consumers.next_worker must list 2 workers"),
        (_with_consumers(remaining=[5, 6, 5, 7]), "consumers.remaining adds up to 23 samples but 'remaining' holds 22"),
        (_with_consumers(remaining=[5, 6, 12, -1]), "consumers.remaining\\[3\\] must be >= 0"),
        (_with_consumers(next_worker=[1, 2]), "consumers.next_worker\\[1\\] is 2, but ranks have 2 workers"),
        (_with_consumers(world_size=True), "consumers.world_size must be an int"),
    ],
)
def test_a_malformed_layout_is_refused_naming_the_field(state: dict, match: str) -> None:
    t = trackers()[0]
    before = t.consumer_slices(0)
    with pytest.raises(TrackerStateError, match=match):
        t.load_global_state(state)
    assert t.consumer_slices(0) == before  # nothing changed


def test_a_local_state_without_next_worker_is_refused() -> None:
    ts = trackers()
    gathered = [t.local_state() for t in ts]
    del gathered[1]["next_worker"]
    with pytest.raises(TrackerStateError, match="rank 1's local state next_worker"):
        ts[0].global_state(gathered)


def test_cut_takes_the_sizes_it_is_given() -> None:
    work = [Interval(0, 2, 7), Interval(3, 0, 4)]
    assert cut(work, [0, 6, 3]) == [[], [Interval(0, 2, 7), Interval(3, 0, 1)], [Interval(3, 1, 4)]]
    with pytest.raises(ValueError, match="cannot cut 9 samples into slices of \\[4, 4\\]"):
        cut(work, [4, 4])


def test_is_even_names_a_fresh_cut() -> None:
    assert ConsumerLayout(2, 2, 1, (3, 3, 2, 2), (0, 0)).is_even()
    assert not ConsumerLayout(2, 2, 1, (3, 3, 2, 2), (0, 1)).is_even()
    assert not ConsumerLayout(2, 2, 1, (2, 3, 3, 2), (0, 0)).is_even()
