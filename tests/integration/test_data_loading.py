"""The tracker behind real ``torch.utils.data.DataLoader`` workers (forked processes), torchdata's
StatefulDataLoader when installed, and DCP saves/loads of its state.

Ranks are simulated in one process here (one tracker and one loader per rank, their local states
gathered by hand); tests/integration/test_data_multirank.py does the same across real torchrun ranks.
The loader's refusals, which need no worker: tests/unit/test_data_inputs.py.
Samples are ``(shard, offset)`` pairs, so every test can compare what was read, sample by sample,
with one uninterrupted epoch.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset, TrackerStateful
from uc_checkpoint.data.tracker import DataTracker, ShardSpec
from uc_checkpoint.errors import DatasetMismatchError

SIZES = (7, 0, 23, 5, 16, 11, 2, 19)
SHARDS = [ShardSpec(f"part-{i:03d}.jsonl", n) for i, n in enumerate(SIZES)]
INDEX = {s.name: i for i, s in enumerate(SHARDS)}


def read_shard(shard: ShardSpec, start: int, end: int):
    """Seeks straight to ``start``; a sample is its own position."""
    for offset in range(start, end):
        yield (INDEX[shard.name], offset)


def as_pairs(batch: Any) -> list[tuple[int, int]]:
    """A collated batch (list of two tensors) back to (shard, offset) pairs."""
    shard, offset = batch
    return list(zip(shard.tolist(), offset.tolist()))


def whole_epoch() -> Counter:
    return Counter((i, j) for i, n in enumerate(SIZES) for j in range(n))


def make_rank_loaders(world: int, workers: int, *, seed: int = 3, batch_size: int = 3, **kwargs: Any):
    trackers = [DataTracker(SHARDS, seed=seed, rank=r, world_size=world, num_workers=workers) for r in range(world)]
    loaders = [
        TrackedDataLoader(TrackedShardDataset(t, read_shard), batch_size=batch_size, num_workers=workers, **kwargs)
        for t in trackers
    ]
    return trackers, loaders


def gather(trackers: list[DataTracker]) -> dict:
    return trackers[0].global_state([t.local_state() for t in trackers])


def consume(loaders: list[TrackedDataLoader], batches_per_rank: list[int] | None) -> list[tuple[int, int]]:
    """Run every rank's loader for the given number of batches (None: to the end); returns what the
    training loop received."""
    seen: list[tuple[int, int]] = []
    for r, loader in enumerate(loaders):
        limit = None if batches_per_rank is None else batches_per_rank[r]
        if limit == 0:
            continue
        for i, batch in enumerate(loader):
            seen += as_pairs(batch)
            if limit is not None and i + 1 == limit:
                break
    return seen


@pytest.mark.parametrize(
    ("before", "after", "cut"),
    [
        ((2, 2), (1, 0), [3, 1]),  # 2 ranks x 2 workers -> 1 rank in the main process
        ((1, 0), (3, 2), [5]),  # main process -> 3 ranks x 2 workers
        ((3, 1), (2, 3), [0, 2, 4]),  # a rank that consumed nothing
    ],
)
def test_interrupted_and_resumed_epoch_reads_every_sample_once(before, after, cut) -> None:
    trackers, loaders = make_rank_loaders(*before)
    first = consume(loaders, cut)
    state = json.loads(json.dumps(gather(trackers)))  # what a checkpoint holds

    trackers2, loaders2 = make_rank_loaders(*after)
    for t in trackers2:
        t.load_global_state(state)
    # Save straight after the resume: nothing consumed yet, the state must not change.
    assert gather(trackers2)["remaining"] == state["remaining"]
    second = consume(loaders2, None)
    assert Counter(first) + Counter(second) == whole_epoch()
    assert trackers2[0].epoch_done([t.local_state() for t in trackers2])


def test_prefetched_batches_are_not_counted_as_consumed() -> None:
    trackers, loaders = make_rank_loaders(1, 2, batch_size=2, prefetch_factor=4)
    it = iter(loaders[0])
    got = as_pairs(next(it)) + as_pairs(next(it)) + as_pairs(next(it))
    state = gather(trackers)  # workers have prefetched well beyond these 3 batches by now
    del it
    assert state["samples_consumed_in_epoch"] == len(got) == 6
    left = Counter((s, o) for s, a, b in state["remaining"] for o in range(a, b))
    assert left + Counter(got) == whole_epoch()


def test_same_run_new_iterator_continues_where_consumption_stopped() -> None:
    trackers, loaders = make_rank_loaders(1, 2, batch_size=4)
    first = consume(loaders, [3])
    second = consume(loaders, None)  # a new iterator of the same assignment
    assert Counter(first) + Counter(second) == whole_epoch()


def worker_pids(loader: TrackedDataLoader) -> list[int]:
    return [p.pid for p in loader._loader._iterator._workers]


def test_epochs_with_persistent_workers_and_a_load_after_they_started() -> None:
    trackers, loaders = make_rank_loaders(1, 2, batch_size=4, persistent_workers=True)
    tracker, loader = trackers[0], loaders[0]
    pids = None
    for epoch in range(3):
        tracker.start_epoch(epoch)
        assert Counter(consume([loader], None)) == whole_epoch(), epoch
        # The same worker processes served every epoch: they followed the new epochs themselves.
        assert pids is None or worker_pids(loader) == pids
        pids = worker_pids(loader)

    tracker.start_epoch(3)
    part = consume([loader], [2])
    state = gather(trackers)
    # Another rank-0 loader whose persistent workers are already running when the state is loaded.
    other, other_loaders = make_rank_loaders(1, 2, batch_size=4, persistent_workers=True)
    consume(other_loaders, [4])
    stale = worker_pids(other_loaders[0])
    other[0].load_global_state(state)
    rest = consume(other_loaders, None)
    assert Counter(part) + Counter(rest) == whole_epoch()
    assert set(worker_pids(other_loaders[0])).isdisjoint(stale)  # restarted to pick up the load


def test_transform_drops_are_counted_in_raw_samples() -> None:
    def keep_even(sample):
        return sample if sample[1] % 2 == 0 else None

    def loaders_for(world: int, workers: int):
        trackers = [DataTracker(SHARDS, rank=r, world_size=world, num_workers=workers) for r in range(world)]
        return trackers, [
            TrackedDataLoader(TrackedShardDataset(t, read_shard, keep_even), batch_size=2, num_workers=workers)
            for t in trackers
        ]

    trackers, loaders = loaders_for(2, 1)
    first = consume(loaders, [2, 3])
    state = gather(trackers)
    trackers2, loaders2 = loaders_for(1, 2)
    trackers2[0].load_global_state(state)
    second = consume(loaders2, None)
    evens = Counter(p for p in whole_epoch() if p[1] % 2 == 0)
    assert Counter(first) + Counter(second) == evens
    assert trackers2[0].epoch_done()  # odd samples at slice ends were accounted for too


def test_stateful_dataloader_from_torchdata() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    trackers, loaders = make_rank_loaders(2, 2, loader_cls=sdl.StatefulDataLoader)
    first = consume(loaders, [2, 4])
    state = gather(trackers)
    trackers2, loaders2 = make_rank_loaders(1, 1, loader_cls=sdl.StatefulDataLoader)
    trackers2[0].load_global_state(state)
    assert Counter(first) + Counter(consume(loaders2, None)) == whole_epoch()


def test_dcp_save_and_load_through_uc_volume(tmp_path: Path, staging: Path) -> None:
    """The loader is a DCP Stateful: saved with the model by UCVolumeWriter, restored by
    UCVolumeReader into a loader with other workers; a different dataset is refused by name."""
    trackers, loaders = make_rank_loaders(1, 2, batch_size=4)
    first = consume(loaders, [3])
    weights = torch.arange(10.0)
    dcp.save({"w": weights, "data": loaders[0]}, storage_writer=UCVolumeWriter(str(tmp_path / "ckpt")))

    trackers2, loaders2 = make_rank_loaders(1, 3, batch_size=4)
    target = {"w": torch.zeros(10), "data": loaders2[0]}
    dcp.load(target, storage_reader=UCVolumeReader(str(tmp_path / "ckpt")))
    assert torch.equal(target["w"], weights)
    assert Counter(first) + Counter(consume(loaders2, None)) == whole_epoch()

    changed = [ShardSpec(s.name, s.num_samples + (i == 4)) for i, s in enumerate(SHARDS)]
    tracker3 = DataTracker(changed)
    with pytest.raises(Exception) as exc:
        dcp.load({"data": TrackerStateful(tracker3)}, storage_reader=UCVolumeReader(str(tmp_path / "ckpt")))
    err = exc.value
    while not isinstance(err, DatasetMismatchError) and (getattr(err, "failures", None) or err.__cause__):
        failures = getattr(err, "failures", None)
        err = next(iter(failures.values())) if failures else err.__cause__
    assert isinstance(err, DatasetMismatchError), repr(exc.value)
    assert "part-004.jsonl" in str(err)


def test_loader_leaves_the_global_rng_alone() -> None:
    """A resumed run creates its loader iterator after restoring the RNG; a plain DataLoader would
    draw its workers' seed from the global RNG there and shift all later random numbers."""
    trackers, loaders = make_rank_loaders(1, 2, batch_size=4)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    consume(loaders, [2])
    consume(loaders, [1])  # a second iterator
    assert torch.equal(torch.rand(3), expected)
