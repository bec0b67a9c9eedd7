"""What the data tracker and its loader refuse or compute in one process, with no DataLoader worker:
malformed tracker states (one documented error type, naming the field; fuzzed states load
consistently or raise it), a reader that yields too few samples, a loader whose workers or work do
not match its tracker, and the batch-aligned slices of ``drop_last``. The tests with real worker
processes are tests/integration/test_data_loading.py and test_data_reloads.py.
"""

from __future__ import annotations

import copy
import json
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset, TrackerStateful
from uc_checkpoint.data.tracker import DataTracker, ShardSpec, iter_positions, slice_sizes
from uc_checkpoint.errors import DataLoadingError, DatasetMismatchError, TrackerStateError, UCCheckpointError

SIZES = (7, 0, 11, 5, 9)  # 32 samples; an empty shard on the way
SHARDS = [ShardSpec(f"part-{i}", n) for i, n in enumerate(SIZES)]
INDEX = {s.name: i for i, s in enumerate(SHARDS)}
SEED = 5
SHARDS50 = [ShardSpec("a", 20), ShardSpec("b", 17), ShardSpec("c", 13)]  # 50 samples


def read_shard(shard: ShardSpec, start: int, end: int):
    """Seeks to ``start``; a sample is its own ``(shard index, offset)``."""
    for offset in range(start, end):
        yield (INDEX[shard.name], offset)


def epoch_samples(shards: list[ShardSpec] = SHARDS) -> Counter:
    return Counter((i, k) for i, s in enumerate(shards) for k in range(s.num_samples))


# ---------------------------------------------------------------------------------------------------
# The loader's refusals.
# ---------------------------------------------------------------------------------------------------


def test_reader_that_yields_too_few_samples_is_named() -> None:
    def short_reader(shard: ShardSpec, start: int, end: int):
        yield from read_shard(shard, start, min(end, start + 1))

    tracker = DataTracker(SHARDS, num_workers=0)
    loader = TrackedDataLoader(TrackedShardDataset(tracker, short_reader), batch_size=2)
    with pytest.raises(DataLoadingError, match=r"read_shard\('part-\d', 0, \d+\) yielded 1 samples"):
        list(loader)


def test_worker_count_must_match_tracker() -> None:
    tracker = DataTracker(SHARDS, num_workers=2)
    with pytest.raises(DataLoadingError, match="num_workers=3 but the DataTracker was built with num_workers=2"):
        TrackedDataLoader(TrackedShardDataset(tracker, read_shard), num_workers=3)
    with pytest.raises(TypeError, match="shuffle"):
        TrackedDataLoader(TrackedShardDataset(tracker, read_shard), num_workers=2, shuffle=True)


def test_changing_the_work_during_an_iteration_is_refused() -> None:
    tracker = DataTracker(SHARDS)
    loader = TrackedDataLoader(TrackedShardDataset(tracker, read_shard), batch_size=2)
    it = iter(loader)
    next(it)
    tracker.start_epoch(1)
    with pytest.raises(DataLoadingError, match="while a loader iterator was running"):
        next(it)


def test_stateful_without_process_group_needs_world_size_one() -> None:
    tracker = DataTracker(SHARDS, rank=0, world_size=2)
    with pytest.raises(DataLoadingError, match="world_size=2 but torch.distributed is not initialised"):
        TrackerStateful(tracker).state_dict()
    with pytest.raises(ValueError, match="not a TrackerStateful state dict"):
        TrackerStateful(tracker).load_state_dict({"other": 1})


# ---------------------------------------------------------------------------------------------------
# drop_last: slices of whole batches, and a tracker cut in the loader's batch size.
# ---------------------------------------------------------------------------------------------------


def loader50(**kwargs: Any) -> TrackedDataLoader:
    """A loader of batch 4 over :data:`SHARDS50` with 2 workers, on a tracker cut per sample; built,
    never iterated, so no worker starts."""
    tracker = DataTracker(SHARDS50, seed=SEED, num_workers=2)
    return TrackedDataLoader(TrackedShardDataset(tracker, read_shard), batch_size=4, num_workers=2, **kwargs)


def test_slice_sizes_are_whole_batches_but_one() -> None:
    assert slice_sizes(50, 2, 4) == [26, 24]
    assert slice_sizes(38, 2, 4) == [20, 18]
    assert slice_sizes(38, 3, 4) == [14, 12, 12]
    assert slice_sizes(10, 3) == [4, 3, 3]  # batch_size 1: the per-sample cut
    rnd = random.Random(0)
    for _ in range(300):
        total, n, b = rnd.randint(0, 200), rnd.randint(1, 9), rnd.randint(1, 9)
        sizes = slice_sizes(total, n, b)
        assert sum(sizes) == total and max(sizes) - min(sizes) <= b
        assert sum(s % b != 0 for s in sizes) <= 1, (total, n, b, sizes)


def test_drop_last_needs_a_batch_aligned_tracker() -> None:
    with pytest.raises(
        DataLoadingError,
        match=r"drop_last=True with batch_size=4 needs a DataTracker built "
        r"with batch_size=4 \(it has batch_size=1\).*drop_last=False",
    ):
        loader50(drop_last=True)
    loader50(drop_last=False)  # no drop, no constraint


def test_ranks_must_cut_in_the_same_batch_size() -> None:
    a = DataTracker(SHARDS50, rank=0, world_size=2, batch_size=4)
    b = DataTracker(SHARDS50, rank=1, world_size=2, batch_size=1)
    with pytest.raises(TrackerStateError, match="batch_size"):
        a.global_state([a.local_state(), b.local_state()])


# ---------------------------------------------------------------------------------------------------
# Malformed states: one error type, naming the field; the tracker is left as it was.
# ---------------------------------------------------------------------------------------------------


def _state() -> dict[str, Any]:
    t = DataTracker(SHARDS, seed=SEED, num_workers=1)
    t.record(0, 9)  # 9 of part-2's 11, the first shard of epoch 0 with this seed
    return json.loads(json.dumps(t.global_state([t.local_state()])))


def _set(key: str, value: Any):
    return lambda s: s.__setitem__(key, value)


def _remaining_of_two_shards(s: dict[str, Any]) -> None:
    # Splits the first interval to get two pieces of one shard, then puts other shards between.
    first, *rest = s["remaining"]
    shard, a, b = first
    s["remaining"] = [[shard, a, a + 1], *rest, [shard, a + 1, b]]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_set("epoch", "1"), "epoch"),  # the input: TypeError before
        (_set("epoch", -1), "epoch"),
        (_set("epoch", True), "epoch"),
        (_set("seed", 1.5), "seed"),
        (_set("num_shards", "5"), "num_shards"),
        (_set("num_shards", -1), "num_shards"),
        (_set("samples_consumed_in_epoch", None), "samples_consumed_in_epoch"),
        (_set("samples_consumed_in_epoch", -3), "samples_consumed_in_epoch"),
        (_set("fingerprint", 7), "fingerprint"),
        (_set("format", "1"), "format"),
        (lambda s: s.pop("seed"), "lacks \\['seed'\\]"),
        (lambda s: s.pop("fingerprint"), "lacks \\['fingerprint'\\]"),
        (_set("remianing", []), "unknown keys \\[\"'remianing'\"\\]"),
        (_set("remaining", "all"), "'remaining'"),
        (_set("remaining", [[2, 0]]), "remaining\\[0\\]"),
        (_set("remaining", [["2", 0, 3]]), "remaining\\[0\\] shard"),
        (_set("remaining", [[2, -1, 3]]), "remaining\\[0\\] start must be >= 0"),
        (_set("remaining", [[2, 5, 3]]), "end < start"),
        (_set("remaining", [[2, 5, 9], [2, 0, 5]]), "out of order"),
        (_remaining_of_two_shards, "stream order"),
        (_set("remaining", [[5, 0, 1]]), "names shard 5 of 5"),
        (_set("remaining", [[2, 0, 12]]), "exceeds its shard 'part-2'"),
        (_set("shards", [["part-0", 7, ""]]), "'shards' must list num_shards=5"),
        (lambda s: s["shards"].__setitem__(3, ["part-3", "5", ""]), "shards\\[3\\] \\('part-3'\\) num_samples"),
        (lambda s: s["shards"].__setitem__(3, "part-3"), "shards\\[3\\]"),
        (lambda s: s["shards"].__setitem__(3, ["part-3", 5]), "shards\\[3\\]"),
        (lambda s: s["shards"].__setitem__(3, ["part-3", 6, ""]), "disagrees with its fingerprint"),
        (_set("shuffle_within_shard", "no"), "shuffle_within_shard"),
        (lambda s: s.pop("digest"), "lacks \\['digest'\\]"),
        (_set("digest", {"2": 9}), "'digest' must be a list"),
        (_set("digest", [[2, 9, "x" * 32]]), "digest\\[0\\]"),
        (_set("digest", [[2, 8, "0" * 32]]), "digest counts 8 samples"),
        (_set("num_shards", 6), "'shards' must list num_shards=6"),
        (lambda s: (s.pop("shards"), s.update(num_shards=6)), "num_shards is 6"),
        (_set("format", True), "format True"),
        (lambda s: s.update(samples_consumed_in_epoch=10, digest=None), "samples_consumed_in_epoch 10"),
    ],
)
def test_malformed_state_raises_tracker_state_error_naming_the_field(mutate, field: str) -> None:
    good = _state()
    DataTracker(SHARDS, seed=SEED).load_global_state(copy.deepcopy(good))  # unmutated: loads
    bad = copy.deepcopy(good)
    mutate(bad)
    tracker = DataTracker(SHARDS, seed=SEED, num_workers=2)
    tracker.record(1, 2)
    before = (tracker.generation, tracker.local_state(), tracker.load_count)
    with pytest.raises(TrackerStateError, match=field) as exc:
        tracker.load_global_state(bad)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, UCCheckpointError)
    assert (tracker.generation, tracker.local_state(), tracker.load_count) == before  # nothing changed
    # The same through the DCP Stateful, which wraps the state in JSON text.
    with pytest.raises(TrackerStateError, match=field):
        TrackerStateful(tracker).load_state_dict({"global_state": json.dumps(bad)})


def test_not_a_state_at_all() -> None:
    tracker = DataTracker(SHARDS)
    with pytest.raises(TrackerStateError, match="must be a dict, got list"):
        tracker.load_global_state([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TrackerStateError, match="'global_state' is not valid JSON"):
        TrackerStateful(tracker).load_state_dict({"global_state": "{nope"})
    with pytest.raises(TrackerStateError, match="no 'global_state' text"):
        TrackerStateful(tracker).load_state_dict({"global_state": 3})
    with pytest.raises(TrackerStateError, match="rank 0 worker 0 consumed must be an int"):
        tracker.global_state([dict(tracker.local_state(), consumed=["1"])])


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.text(max_size=3), st.floats(allow_nan=False))
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_states_load_consistently_or_raise_tracker_state_error(data) -> None:
    """Replace, drop or add fields (and remaining intervals) with random JSON values: the load
    either succeeds with a consistent tracker or raises TrackerStateError (DatasetMismatchError when
    the fingerprint no longer matches) and never any other exception."""
    state = _state()
    keys = sorted(state)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        how = data.draw(st.sampled_from(["replace", "drop", "add", "interval"]), label="how")
        if how == "replace":
            state[data.draw(st.sampled_from(keys), label="key")] = data.draw(_json, label="value")
        elif how == "drop":
            state.pop(data.draw(st.sampled_from(keys), label="key"), None)
        elif how == "add":
            state[data.draw(st.text(min_size=1, max_size=4), label="new key")] = data.draw(_json, label="value")
        elif isinstance(state.get("remaining"), list) and state["remaining"]:
            i = data.draw(st.integers(0, len(state["remaining"]) - 1), label="interval")
            state["remaining"][i] = data.draw(
                st.one_of(_json, st.lists(st.integers(-2, 15), min_size=3, max_size=3)), label="interval value"
            )
    tracker = DataTracker(SHARDS, seed=SEED, num_workers=2)
    try:
        tracker.load_global_state(state)
    except (TrackerStateError, DatasetMismatchError):
        return
    # Loaded: the work must still be a set of distinct samples of the dataset.
    left = [p for w in range(2) for p in iter_positions(tracker.consumer_slices(w))]
    assert len(left) == len(set(left)) and set(left) <= set(epoch_samples())
    assert tracker.global_state([tracker.local_state()])["samples_consumed_in_epoch"] == sum(SIZES) - len(left)


def test_a_state_nested_too_deep_for_json_is_a_tracker_state_error() -> None:
    from uc_checkpoint import TrackerStateError
    from uc_checkpoint.data.loading import TrackerStateful
    from uc_checkpoint.data.tracker import DataTracker, ShardSpec

    stateful = TrackerStateful(DataTracker([ShardSpec("a", 4)], seed=0))
    with pytest.raises(TrackerStateError, match="not valid JSON"):
        stateful.load_state_dict({"global_state": "[" * 100_000 + "]" * 100_000})
