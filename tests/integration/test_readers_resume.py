"""Every shard reader behind the tracker and real DataLoader workers (forked processes): an epoch
interrupted on 2 ranks x 2 workers and resumed on 1 rank x 3 workers reads every sample exactly
once; with shuffling within shards, a lock-step interruption resumed on the same topology reads in
the uninterrupted run's order; a resume after a shard file changed is refused, and so is a read in
a forked worker of a shard changed after ``shards()``.

Ranks are simulated in one process (one tracker and loader per rank, local states gathered by hand),
as in tests/integration/test_data_loading.py.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.reader_data import FORMATS, plain
from tests.support.shard_edits import rewrite_with_other_samples
from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.data.readers import ShardReader
from uc_checkpoint.data.tracker import DataTracker
from uc_checkpoint.errors import DatasetMismatchError

NAMES = sorted(FORMATS)


def identity(sample: Any) -> str:
    """What a sample is, as a string (runs in the workers)."""
    return repr(plain(sample))


def as_list(items: list[Any]) -> list[Any]:
    return items


def build(fmt: str, root: Path) -> tuple[ShardReader, list[str]]:
    root.mkdir()
    sizes = [40, 40, 40] if FORMATS[fmt].equal_sizes else [37, 53, 21]
    expected = FORMATS[fmt].write(root, sizes)
    return FORMATS[fmt].reader(root), [repr(s) for shard in expected for s in shard]


def loaders(reader: ShardReader, shards: list, world: int, workers: int, **tracker_kwargs: Any):
    trackers = [
        DataTracker(shards, seed=5, rank=r, world_size=world, num_workers=workers, **tracker_kwargs)
        for r in range(world)
    ]
    made = [
        TrackedDataLoader(
            TrackedShardDataset(t, reader, transform=identity), batch_size=4, num_workers=workers, collate_fn=as_list
        )
        for t in trackers
    ]
    return trackers, made


def run(made: list[TrackedDataLoader], batches: int | None) -> list[str]:
    seen: list[str] = []
    for loader in made:
        for i, batch in enumerate(loader):
            seen += batch
            if batches is not None and i + 1 == batches:
                break
    return seen


def state_of(trackers: list[DataTracker]) -> dict:
    return trackers[0].global_state([t.local_state() for t in trackers])


@pytest.mark.parametrize("fmt", NAMES)
def test_resume_on_another_topology_reads_each_sample_once(fmt: str, tmp_path: Path) -> None:
    reader, every = build(fmt, tmp_path / "data")
    shards = reader.shards()
    trackers, made = loaders(reader, shards, world=2, workers=2)
    trackers[0].start_epoch(0)
    trackers[1].start_epoch(0)
    first = run(made, batches=3)
    state = state_of(trackers)

    again = FORMATS[fmt].reader(tmp_path / "data")  # a new job: discovers the same shards
    trackers2, made2 = loaders(again, again.shards(), world=1, workers=3)
    trackers2[0].load_global_state(state)
    trackers2[0].start_epoch(0)
    rest = run(made2, batches=None)
    assert len(first) == 2 * 3 * 4
    assert Counter(first + rest) == Counter(every)


@pytest.mark.parametrize("fmt", NAMES)
def test_shuffled_within_shards_resumes_in_the_uninterrupted_order(fmt: str, tmp_path: Path) -> None:
    reader, every = build(fmt, tmp_path / "data")
    shards = reader.shards()
    if not reader.random_access:
        with pytest.raises(TypeError, match="random-access"):
            TrackedShardDataset(DataTracker(shards, shuffle_within_shard=True), reader)
        return
    trackers, made = loaders(reader, shards, world=1, workers=2, shuffle_within_shard=True)
    trackers[0].start_epoch(0)
    whole = run(made, batches=None)
    assert Counter(whole) == Counter(every)
    assert whole != [s for s in every]  # shuffled: not the stored order

    trackers, made = loaders(reader, shards, world=1, workers=2, shuffle_within_shard=True)
    trackers[0].start_epoch(0)
    head = run(made, batches=4)  # workers take turns: 2 batches each, lock-step
    state = state_of(trackers)
    trackers2, made2 = loaders(
        FORMATS[fmt].reader(tmp_path / "data"), shards, world=1, workers=2, shuffle_within_shard=True
    )
    trackers2[0].load_global_state(state)
    trackers2[0].start_epoch(0)
    assert head + run(made2, batches=None) == whole


@pytest.mark.parametrize("fmt", NAMES)
def test_resume_after_a_file_changed_is_refused(fmt: str, tmp_path: Path) -> None:
    reader, _ = build(fmt, tmp_path / "data")
    trackers, made = loaders(reader, reader.shards(), world=1, workers=0)
    trackers[0].start_epoch(0)
    run(made, batches=2)
    state = state_of(trackers)
    name = rewrite_with_other_samples(fmt, tmp_path / "data", 1, tmp_path / "scratch")  # same name and count
    fresh = FORMATS[fmt].reader(tmp_path / "data")
    tracker = DataTracker(fresh.shards(), seed=5)
    with pytest.raises(DatasetMismatchError, match=rf"'{name}' \(\d+ samples\) changed content"):
        tracker.load_global_state(state)


def touch(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 3_000_000_000))


@pytest.mark.parametrize("edit", ["rewritten", "touched"])
@pytest.mark.parametrize("fmt", NAMES)
def test_forked_workers_check_a_shard_changed_after_shards(fmt: str, edit: str, tmp_path: Path) -> None:
    """Forked DataLoader workers inherit the reader that listed the shards; each still checks every
    shard before its first read, as spawned ones do."""
    reader, _ = build(fmt, tmp_path / "data")
    shards = reader.shards()
    list(reader(shards[0], 0, 1))  # the main process has read (and checked) a shard already
    tracker = DataTracker(shards, seed=5, num_workers=2)
    loader = TrackedDataLoader(
        TrackedShardDataset(tracker, reader, transform=identity),
        batch_size=4,
        num_workers=2,
        collate_fn=as_list,
        multiprocessing_context="fork",
    )
    for index in range(len(shards)):
        if edit == "rewritten":
            rewrite_with_other_samples(fmt, tmp_path / "data", index, tmp_path / f"scratch-{index}")
        else:
            touch(tmp_path / "data" / shards[index].name)
    with pytest.raises(DatasetMismatchError, match="changed since its shard list was made"):
        run([loader], batches=None)
