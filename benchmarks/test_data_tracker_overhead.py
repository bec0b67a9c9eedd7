"""Per-sample cost of data tracking, in pytest-benchmark's rounds and statistics.

* ``record``: the bookkeeping call the loader makes per batch, one benchmarked call per sample (the
  worst case, ``batch_size=1``), so the table is the per-sample time.
* loader epoch: the same in-memory samples through a plain ``DataLoader`` over a plain
  ``IterableDataset`` and through :class:`TrackedDataLoader` (main process, and 2 persistent
  workers), batch 32, loaders built and workers started before timing; one benchmarked call is an
  epoch, and ``extra_info["us_per_sample"]`` its median per sample. The difference per sample is what
  tracking adds (tagging in the worker, the tagged collate, the record in the main process); the
  tracked runs go with the exactly-once digest on (``raise``, the default) and ``off``, whose
  difference is the digest's share (identities collected in the worker, hashed per batch in the
  collate, added up in the main process).

Run: ``./scripts/test.sh benchmarks/test_data_tracker_overhead.py -n 0 --benchmark-enable --benchmark-only``
(``UC_BENCH_SAMPLES`` sets the samples per epoch, default 20000).
"""

from __future__ import annotations

import itertools
import os

import pytest
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.data.tracker import DataTracker, ShardSpec

# Quick mode (--benchmark-disable, as in CI): a small epoch, run once, so the module cannot rot.
SAMPLES = 1600 if os.environ.get("UC_BENCH_QUICK") else int(os.environ.get("UC_BENCH_SAMPLES", "20000"))
SHARDS = [ShardSpec(f"shard-{i:04d}", SAMPLES // 16) for i in range(16)]
BATCH = 32


def read_shard(shard: ShardSpec, start: int, end: int):
    yield from range(start, end)


class PlainShards(IterableDataset):
    """The same samples without tracking: each worker takes every n-th shard."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for shard in SHARDS[worker::workers]:
            yield from read_shard(shard, 0, shard.num_samples)


def drain(loader) -> int:
    n = 0
    for batch in loader:
        n += len(batch)
    return n


def test_record_per_sample(benchmark) -> None:
    # An epoch far longer than pytest-benchmark's calibrated rounds can consume.
    tracker = DataTracker([ShardSpec("all", 1 << 40)])
    benchmark(tracker.record, 0, 1)
    assert tracker.samples_consumed(0) >= 1


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    ("tracked", "exactly_once"),
    [(False, "off"), (True, "off"), (True, "raise")],
    ids=["plain", "tracked-digest-off", "tracked-digest-on"],
)
def test_loader_epoch(benchmark, workers: int, tracked: bool, exactly_once: str) -> None:
    """One epoch per round through a loader built once (persistent workers with 2 workers), so
    that process start-up and construction are not part of the figure."""
    persistent = workers > 0
    if tracked:
        tracker = DataTracker(SHARDS, num_workers=workers, exactly_once=exactly_once)
        loader = TrackedDataLoader(
            TrackedShardDataset(tracker, read_shard),
            batch_size=BATCH,
            num_workers=workers,
            persistent_workers=persistent,
        )
    else:
        tracker = None
        loader = DataLoader(PlainShards(), batch_size=BATCH, num_workers=workers, persistent_workers=persistent)
    epochs = itertools.count(1)
    drain(loader)  # warm-up: starts the workers

    def run() -> int:
        if tracker is not None:
            tracker.start_epoch(next(epochs))
        return drain(loader)

    n = benchmark(run)
    assert n == sum(s.num_samples for s in SHARDS)
    benchmark.extra_info["samples"] = n
    if benchmark.enabled:
        benchmark.extra_info["us_per_sample"] = benchmark.stats.stats.median / n * 1e6
