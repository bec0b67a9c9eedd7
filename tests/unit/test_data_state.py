"""uc_checkpoint.data.state: the saved dict's format (2) is pinned byte for byte, format 1 is refused,
every malformed state is a TrackerStateError (a ValueError too), and data/ stays apart from the rest
of the package."""

from __future__ import annotations

import ast
import copy
import json
import pickle
import warnings
from pathlib import Path

import pytest

import uc_checkpoint
from uc_checkpoint.data.config import TrackerConfig
from uc_checkpoint.data.intervals import Interval, ShardSpec
from uc_checkpoint.data.state import TrackerState, merge_local_states
from uc_checkpoint.data.tracker import DataTracker
from uc_checkpoint.errors import TrackerStateError, UCCheckpointError

PACKAGE = Path(uc_checkpoint.__file__).resolve().parent
SHARDS = [ShardSpec(f"s{i}", n) for i, n in enumerate([7, 0, 13, 5, 9])]
FINGERPRINT = "399a0e582daa0c8241ebcf669b4dec6c45b3b33e8299cbf71a5d91955cd56067"
# global_state() of two ranks with two workers each after recording (3, 4) and (1, 5) samples
# (format 3; the digest pins the sample hashes, which a saved run's check depends on).
DIGEST = [
    [0, 3, "56ac544d166c162fc6758ddb8d9d7b8d"],
    [2, 2, "14309f65834843a7a6a21ad981b2a096"],
    [3, 3, "1e4232f7b89913eeefb93ca35153e406"],
    [4, 5, "42e44690b8227bf4c380a7badf1ef428"],
]
SAVED = {
    "format": 3,
    "fingerprint": FINGERPRINT,
    "seed": 3,
    "epoch": 0,
    "shuffle_within_shard": False,
    "remaining": [[0, 3, 7], [3, 0, 2], [2, 1, 6], [2, 7, 13], [4, 0, 1], [4, 6, 9]],
    "samples_consumed_in_epoch": 13,
    "num_shards": 5,
    "digest": DIGEST,
    "shards": [["s0", 7, ""], ["s1", 0, ""], ["s2", 13, ""], ["s3", 5, ""], ["s4", 9, ""]],
    # Uneven progress: what each consumer has left and each rank's next worker (data/layout.py).
    "consumers": {
        "world_size": 2,
        "workers_per_rank": 2,
        "batch_size": 1,
        "remaining": [6, 5, 7, 3],
        "next_worker": [0, 0],
    },
}
SAVED_JSON = (
    '{"format":3,"fingerprint":"' + FINGERPRINT + '","seed":3,"epoch":0,"shuffle_within_shard":false,'
    '"remaining":[[0,3,7],[3,0,2],[2,1,6],[2,7,13],[4,0,1],[4,6,9]],"samples_consumed_in_epoch":13,'
    '"num_shards":5,"digest":' + json.dumps(DIGEST, separators=(",", ":")) + ',"shards":[["s0",7,""],'
    '["s1",0,""],["s2",13,""],["s3",5,""],["s4",9,""]],"consumers":{"world_size":2,"workers_per_rank":2,'
    '"batch_size":1,"remaining":[6,5,7,3],"next_worker":[0,0]}}'
)


def saved_by_two_ranks(include_shard_list: bool = True) -> dict:
    ts = [DataTracker(SHARDS, seed=3, rank=r, world_size=2, num_workers=2) for r in range(2)]
    for t, (a, b) in zip(ts, [(3, 4), (1, 5)]):
        t.record(0, a)
        t.record(1, b)
    return ts[0].global_state([t.local_state() for t in ts], include_shard_list=include_shard_list)


def test_global_state_is_the_pinned_format_3_dict() -> None:
    saved = saved_by_two_ranks()
    assert saved == SAVED and list(saved) == list(SAVED)  # the same keys in the same order
    assert json.dumps(saved, separators=(",", ":")) == SAVED_JSON
    without = saved_by_two_ranks(include_shard_list=False)
    assert without == {k: v for k, v in SAVED.items() if k != "shards"}


def test_tracker_state_round_trips_the_saved_dict() -> None:
    parsed = TrackerState.from_dict(copy.deepcopy(SAVED))
    assert parsed.remaining[0] == Interval(0, 3, 7) and parsed.shards is not None
    assert parsed.to_dict() == SAVED and list(parsed.to_dict()) == list(SAVED)
    parsed.check_fits(SHARDS)
    no_list = {k: v for k, v in SAVED.items() if k != "shards"}
    assert TrackerState.from_dict(no_list).to_dict() == no_list


def test_format_1_is_refused_naming_both_formats() -> None:
    old = {k: v for k, v in SAVED.items() if k not in ("shuffle_within_shard", "digest", "shards")}
    with pytest.raises(TrackerStateError, match="unsupported data tracker state format 1: this version reads format 3"):
        DataTracker(SHARDS).load_global_state({**old, "format": 1})


def test_format_2_is_refused_saying_why() -> None:
    """Format 2's reader-made shards were URLs with mtime or ETag fingerprints: loading one must not
    pass for another dataset or a moved one, it is refused as a format."""
    with pytest.raises(TrackerStateError, match=r"format 2: this version reads format 3 only \(format 2 named"):
        DataTracker(SHARDS).load_global_state({**SAVED, "format": 2})


def test_the_pinned_state_loads_and_resumes_the_same() -> None:
    r = DataTracker(SHARDS, seed=9, world_size=3, rank=1, num_workers=1, batch_size=2)
    r.load_global_state(copy.deepcopy(SAVED))
    assert r.config.seed == 3 and r.work_from_checkpoint
    assert r.assignment_id == "831c906f992c7f9b"  # pinned: unshuffled ids are as they always were
    assert r.consumer_slices(0) == [Interval(2, 3, 6), Interval(2, 7, 11)]


def test_tracker_state_error_is_both_ours_and_a_value_error() -> None:
    assert issubclass(TrackerStateError, UCCheckpointError) and issubclass(TrackerStateError, ValueError)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format": True}, "unsupported data tracker state format True"),
        ({"epoch": "1"}, "epoch must be an int"),
        ({"extra": 1}, "unknown keys"),
        ({"remaining": [[0, 0, 3], [2, 0, 1], [0, 4, 5]]}, "returns to shard 0"),
        ({"remaining": [[0, 0, 8]]}, "exceeds its shard 's0'"),
        ({"shards": [["s0", 7, ""]]}, "'shards' must list num_shards=5"),
        ({"shards": [["s0", 7]] * 5}, "not \\[name, num_samples, fingerprint\\]"),
        ({"shuffle_within_shard": 1}, "shuffle_within_shard must be a bool"),
        ({"digest": [[0, 3, "56ac"]]}, "digest\\[0\\]"),
        ({"digest": [[2, 2, "7" * 32], [0, 3, "0" * 32]]}, "digest\\[1\\]"),  # shards out of order
        ({"digest": DIGEST[:3]}, "its digest counts 8 samples but samples_consumed_in_epoch is 13"),
    ],
)
def test_from_dict_refuses_malformed_states(change: dict, match: str) -> None:
    with pytest.raises(TrackerStateError, match=match):
        TrackerState.from_dict({**SAVED, **change})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_shards": 4, "shards": [["s0", 7, ""]] * 4, "remaining": [], "digest": None}, "num_shards is 4"),
        ({"samples_consumed_in_epoch": 3, "digest": None}, "samples_consumed_in_epoch 3 \\+ 21 remaining"),
        (
            {"shards": [["s0", 7, ""], ["s1", 0, ""], ["s2", 13, ""], ["s3", 5, ""], ["s4", 10, ""]]},
            "shards list disagrees",
        ),
    ],
)
def test_check_fits_refuses_states_that_contradict_their_fingerprint(change: dict, match: str) -> None:
    state = {k: v for k, v in SAVED.items() if k != "consumers"}  # its sum is checked by from_dict
    with pytest.raises(TrackerStateError, match=match):
        TrackerState.from_dict({**state, **change}).check_fits(SHARDS)


def test_merge_local_states_orders_consumers_by_rank() -> None:
    locals_ = [
        {"rank": 1, "consumed": [2, 0], "epoch": 0, "assignment": "a", "digest": [[1, 2, "0" * 31 + "1"]]},
        {"rank": 0, "consumed": [1, 3], "epoch": 0, "assignment": "a", "digest": [[1, 4, "0" * 31 + "2"]]},
    ]
    kw = {"world_size": 2, "workers_per_rank": 2, "epoch": 0, "slice_sizes": [3, 3, 3, 3], "num_shards": 2}
    merged, digest = merge_local_states(locals_, assignment="a", **kw)
    assert merged == [1, 3, 2, 0]
    assert digest is not None and digest.to_list() == [[1, 6, "0" * 31 + "3"]]
    with pytest.raises(TrackerStateError, match="from epoch 0 / assignment a"):
        merge_local_states(locals_, assignment="b", **kw)
    locals_[0]["digest"] = [[1, 1, "0" * 32]]
    with pytest.raises(TrackerStateError, match="rank 1's local digest counts 1 samples but its workers consumed 2"):
        merge_local_states(locals_, assignment="a", **kw)
    locals_[0]["digest"] = None  # a rank with the check off: the epoch's digest is unknown
    assert merge_local_states(locals_, assignment="a", **kw)[1] is None


def test_tracker_config_is_checked_frozen_and_builds_the_same_tracker() -> None:
    config = TrackerConfig(tuple(SHARDS), seed=3, rank=1, world_size=2, num_workers=2, batch_size=2)
    assert config.fingerprint == FINGERPRINT and config.total_samples == 34
    assert config.workers_per_rank == 2 and config.num_consumers == 4
    with pytest.raises(AttributeError):
        config.seed = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        TrackerConfig(tuple(SHARDS), rank=2, world_size=2)
    a = DataTracker.from_config(config)
    b = DataTracker(SHARDS, seed=3, rank=1, world_size=2, num_workers=2, batch_size=2)
    assert a.config == b.config and a.assignment_id == b.assignment_id
    assert a.consumer_slices(1) == b.consumer_slices(1)


def test_restored_epoch_is_continued_once_then_restarted() -> None:
    """The one field that replaced the _restored/_from_load flags: loaded work is continued by the
    first start_epoch of its epoch only, and stays "from the checkpoint" until an epoch is started."""
    t = DataTracker(SHARDS)
    t.load_global_state(copy.deepcopy(SAVED))
    generation = t.generation
    t.start_epoch(0)
    assert t.generation == generation and t.work_from_checkpoint and t.samples_left() == 21
    t.start_epoch(0)
    assert t.generation == generation + 1 and not t.work_from_checkpoint and t.samples_left() == 34


def test_tracker_pickles_for_spawned_workers() -> None:
    t = DataTracker(SHARDS, num_workers=2)
    t.load_global_state(copy.deepcopy(SAVED))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy_ = pickle.loads(pickle.dumps(t))
    assert copy_.assignment_id == t.assignment_id and copy_.work_from_checkpoint and copy_.config == t.config


def test_data_package_imports_only_errors_and_the_tracker_no_torch() -> None:
    for path in sorted((PACKAGE / "data").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path.name}: relative import")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                if name.startswith("uc_checkpoint"):
                    assert name == "uc_checkpoint.errors" or name.startswith("uc_checkpoint.data"), (path.name, name)
                if name.startswith("torch"):
                    assert path.name == "loading.py", (path.name, name)
    # That importing them loads no torch, in a fresh interpreter: tests/integration/test_fresh_interpreter.py.
