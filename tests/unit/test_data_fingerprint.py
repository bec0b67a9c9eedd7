"""Shard content fingerprints: a resume onto a shard whose file changed (same name, same count) is
refused naming the shard and both fingerprints; an unknown fingerprint ("") matches by name and count."""

from __future__ import annotations

import json
import logging

import pytest

from uc_checkpoint.data.intervals import ShardSpec, dataset_fingerprint
from uc_checkpoint.data.tracker import DataTracker
from uc_checkpoint.errors import DatasetMismatchError

V1 = [ShardSpec(f"part-{i}.jsonl", 10, f"size={100 + i},ends_sha256={i:032x}") for i in range(3)]
EDITED = [V1[0], ShardSpec(V1[1].name, 10, f"size=101,ends_sha256={'e' * 32}"), V1[2]]  # part-1 rewritten
UNKNOWN = [ShardSpec(s.name, s.num_samples) for s in V1]


def half_epoch(shards, **kw) -> dict:
    t = DataTracker(shards, seed=2)
    t.record(0, 15)
    return json.loads(json.dumps(t.global_state([t.local_state()], **kw)))


def test_fingerprint_enters_the_dataset_fingerprint_only_when_known() -> None:
    assert dataset_fingerprint(V1) != dataset_fingerprint(EDITED)
    assert dataset_fingerprint(V1) != dataset_fingerprint(UNKNOWN)
    # Unknown fingerprints hash as names and counts alone (the pinned value of test_data_state).
    plain = [ShardSpec(f"s{i}", n) for i, n in enumerate([7, 0, 13, 5, 9])]
    assert dataset_fingerprint(plain) == "399a0e582daa0c8241ebcf669b4dec6c45b3b33e8299cbf71a5d91955cd56067"
    # Length prefixes: a fingerprint cannot pass for part of the next shard.
    assert dataset_fingerprint([ShardSpec("a", 1, "x\nb:1")]) != dataset_fingerprint(
        [ShardSpec("a", 1, "x"), ShardSpec("b", 1)]
    )
    with pytest.raises(TypeError, match="fingerprint must be a str"):
        ShardSpec("a", 1, None)  # type: ignore[arg-type]


def test_the_state_carries_the_fingerprints() -> None:
    state = half_epoch(V1)
    assert state["shards"][1] == ["part-1.jsonl", 10, f"size=101,ends_sha256={1:032x}"]
    assert state["fingerprint"] == dataset_fingerprint(V1)


def test_a_changed_file_is_refused_naming_the_shard_and_both_fingerprints() -> None:
    state = half_epoch(V1)
    with pytest.raises(DatasetMismatchError) as exc:
        DataTracker(EDITED).load_global_state(state)
    msg = str(exc.value)
    assert "shard 1 'part-1.jsonl' (10 samples) changed content" in msg
    assert f"'size=101,ends_sha256={1:032x}'" in msg and f"'size=101,ends_sha256={'e' * 32}'" in msg
    assert "allow_dataset_change=True" in msg
    # Without the shard list the state cannot say which shard, but still refuses.
    with pytest.raises(DatasetMismatchError, match="different names, sizes, contents or order"):
        DataTracker(EDITED).load_global_state(half_epoch(V1, include_shard_list=False))


def test_allow_dataset_change_goes_on_with_a_warning(caplog) -> None:
    t = DataTracker(EDITED, allow_dataset_change=True)
    with caplog.at_level(logging.WARNING):
        t.load_global_state(half_epoch(V1))
    assert "changed content" in caplog.text and t.samples_left() == 15
    assert t.dataset_change is not None and t.dataset_change.changed_content == ("part-1.jsonl",)
    assert t.dataset_change.dropped == 0 and t.dataset_change.carried == 15


@pytest.mark.parametrize(("saved", "now"), [(V1, UNKNOWN), (UNKNOWN, V1)])
def test_an_unknown_fingerprint_matches_by_name_and_count(saved, now) -> None:
    t = DataTracker(now)
    t.load_global_state(half_epoch(saved))
    assert t.samples_left() == 15
    t.record(0, 15)
    assert t.epoch_done()  # and the exactly-once digest, keyed by name, carried over
    # Names and counts still count: a resized shard is refused.
    resized = [now[0], ShardSpec(now[1].name, 11, now[1].fingerprint), now[2]]
    with pytest.raises(DatasetMismatchError, match="first difference at shard 1"):
        DataTracker(resized).load_global_state(half_epoch(saved))
