"""uc_checkpoint.data.intervals: the tracker's pure arithmetic, table-tested (the property tests over
random datasets and topologies are in test_data_tracker.py)."""

from __future__ import annotations

import pytest

from uc_checkpoint.data.dataset_change import carry_over
from uc_checkpoint.data.intervals import (
    Interval,
    ShardSpec,
    assign,
    assignment_id,
    check_int,
    coalesce,
    dataset_fingerprint,
    drop_prefix,
    epoch_shard_order,
    slice_sizes,
    total_size,
    whole_epoch,
)

I = Interval  # noqa: E741 - short rows keep the tables readable
SHARDS = [ShardSpec(f"s{i}", n) for i, n in enumerate([7, 0, 13, 5, 9])]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ([], []),
        ([I(0, 2, 2)], []),
        ([I(0, 0, 3), I(0, 3, 5)], [I(0, 0, 5)]),
        ([I(0, 0, 3), I(0, 4, 5)], [I(0, 0, 3), I(0, 4, 5)]),  # a gap stays
        ([I(0, 0, 3), I(1, 3, 5)], [I(0, 0, 3), I(1, 3, 5)]),  # another shard stays
        ([I(0, 0, 3), I(1, 0, 0), I(0, 3, 4)], [I(0, 0, 4)]),  # an empty piece between neighbours
        ([I(2, 0, 1), I(2, 1, 2), I(2, 2, 3)], [I(2, 0, 3)]),
    ],
)
def test_coalesce(given: list[Interval], expected: list[Interval]) -> None:
    assert coalesce(given) == expected


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (0, [I(0, 2, 5), I(3, 0, 4)]),
        (2, [I(0, 4, 5), I(3, 0, 4)]),
        (3, [I(3, 0, 4)]),
        (4, [I(3, 1, 4)]),
        (7, []),
        (99, []),
    ],
)
def test_drop_prefix(count: int, expected: list[Interval]) -> None:
    assert drop_prefix([I(0, 2, 5), I(3, 0, 4)], count) == expected


@pytest.mark.parametrize(
    ("total", "consumers", "batch", "expected"),
    [
        (0, 3, 1, [0, 0, 0]),
        (10, 3, 1, [4, 3, 3]),
        (2, 3, 1, [1, 1, 0]),
        (10, 3, 2, [4, 4, 2]),  # 5 batches: 2, 2, 1
        (11, 3, 2, [4, 4, 3]),  # the partial sample goes to the first consumer with a batch fewer
        (7, 2, 4, [4, 3]),
        (3, 2, 4, [3, 0]),
        (12, 3, 4, [4, 4, 4]),
        (13, 3, 4, [5, 4, 4]),  # all alike: the partial batch goes to consumer 0
    ],
)
def test_slice_sizes(total: int, consumers: int, batch: int, expected: list[int]) -> None:
    assert slice_sizes(total, consumers, batch) == expected


@pytest.mark.parametrize(
    ("work", "consumers", "batch", "expected"),
    [
        ([], 2, 1, [[], []]),
        ([I(0, 0, 5)], 2, 1, [[I(0, 0, 3)], [I(0, 3, 5)]]),
        ([I(1, 2, 4), I(0, 0, 3)], 2, 1, [[I(1, 2, 4), I(0, 0, 1)], [I(0, 1, 3)]]),
        ([I(0, 0, 2), I(0, 2, 4)], 1, 1, [[I(0, 0, 4)]]),  # neighbours merged
        ([I(0, 0, 5)], 2, 2, [[I(0, 0, 3)], [I(0, 3, 5)]]),  # 2 batches of 2, the partial sample to consumer 0
        ([I(0, 0, 1)], 3, 1, [[I(0, 0, 1)], [], []]),
    ],
)
def test_assign(work: list[Interval], consumers: int, batch: int, expected: list[list[Interval]]) -> None:
    assert assign(work, consumers, batch) == expected


def test_epoch_order_fingerprint_and_assignment_id_are_what_they_always_were() -> None:
    """Fixed values, computed before the tracker moved into uc_checkpoint.data: a saved run's shard
    order and dataset identity must not change with the code's layout."""
    assert epoch_shard_order(10, 7, 3) == [7, 9, 5, 2, 6, 0, 3, 4, 1, 8]
    fp = dataset_fingerprint(SHARDS)
    assert fp == "399a0e582daa0c8241ebcf669b4dec6c45b3b33e8299cbf71a5d91955cd56067"
    work = whole_epoch(SHARDS, 3, 0)
    assert assignment_id(fp, 0, 4, 1, work) == "28003a24f868b447"


def test_whole_epoch_skips_empty_shards_in_epoch_order() -> None:
    work = whole_epoch(SHARDS, 3, 4)
    assert [iv.shard for iv in work] == [i for i in epoch_shard_order(5, 3, 4) if i != 1]
    assert all(iv.start == 0 and iv.end == SHARDS[iv.shard].num_samples for iv in work)
    assert total_size(work) == 34


THREE = [I(0, 1, 5), I(1, 0, 3), I(2, 0, 3)]


@pytest.mark.parametrize(
    ("remaining", "saved_shards", "now", "expected", "unmapped"),
    [
        # by name: s1 moved to index 0, s0 is gone (4 unmapped), s2 shrank to 2 (1 unmapped)
        (
            THREE,
            [("s0", 5), ("s1", 5), ("s2", 5)],
            [("s1", 5), ("s2", 2)],
            [I(0, 0, 3), I(1, 0, 2)],
            [("s0", 4), ("s2", 1)],
        ),
        # a name listed twice maps copy to copy
        ([I(0, 1, 3), I(1, 0, 3)], [("a", 3), ("a", 3)], [("a", 3), ("b", 1), ("a", 3)], [I(0, 1, 3), I(2, 0, 3)], []),
        # without the saved list: by index; shard 2 is gone
        (THREE, None, [("x", 5), ("y", 5)], [I(0, 1, 5), I(1, 0, 3)], [("#2", 3)]),
        # a shard shrank below the interval's start: all of it unmapped
        ([I(0, 4, 6)], None, [("x", 3)], [], [("#0", 2)]),
    ],
)
def test_carry_over(
    remaining: list[Interval],
    saved_shards: list[tuple[str, int]] | None,
    now: list[tuple[str, int]],
    expected: list[Interval],
    unmapped: list[tuple[str, int]],
) -> None:
    saved = None if saved_shards is None else [(n, k, "") for n, k in saved_shards]
    kept, change = carry_over(remaining, saved, [ShardSpec(n, k) for n, k in now], shuffled=False, difference="differs")
    assert kept == expected and change.carried == total_size(kept)
    assert [(u.name, u.samples) for u in change.unmapped] == unmapped
    assert change.dropped == total_size(remaining) - total_size(kept)


def test_carry_over_does_not_carry_shuffled_positions_of_a_resized_shard() -> None:
    saved = [("a", 5, "size=1,ends_sha256=0"), ("b", 4, "size=1,ends_sha256=0")]
    now = [ShardSpec("a", 6), ShardSpec("b", 4, "size=1,ends_sha256=1")]
    kept, change = carry_over([I(0, 2, 5), I(1, 0, 4)], saved, now, shuffled=True, difference="differs")
    assert kept == [I(1, 0, 4)]  # b kept its size: its permutation, and so its positions, still hold
    assert [(u.name, u.samples) for u in change.unmapped] == [("a", 3)]
    assert "5 -> 6 samples with shuffle_within_shard" in change.unmapped[0].reason
    assert change.changed_content == ("b",) and change.added == ("a (+1 samples)",)
    assert "3 unread samples cannot be carried over: 'a': 3 unread samples" in change.describe()


@pytest.mark.parametrize(
    ("value", "exc"),
    [(True, TypeError), (1.0, TypeError), ("1", TypeError), (-1, ValueError)],
)
def test_check_int_refuses(value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match="x must be"):
        check_int(value, "x", minimum=0)
