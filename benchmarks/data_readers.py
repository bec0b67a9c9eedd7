"""Samples per second of each shard reader, beside a plain loop over the format's own library.

For every format, a few MB of local shards are written by the format's library
(tests/support/reader_data.py), then one epoch is read four ways, each timed as the best of
``--repeat`` runs:

* ``library``: a plain loop over the library's own reader (numpy memmap windows, pyarrow
  ``iter_batches``, ``json.loads`` per line, ``gzip.open``, ``tarfile``, ``datasets`` rows);
* ``reader``: ``reader(shard, 0, n)`` over every shard (no tracker, no DataLoader);
* ``tracked``: :class:`TrackedDataLoader` over the reader (main process, batch 64, list collate);
* ``tracked+shuffle``: the same with ``shuffle_within_shard=True`` (random-access formats only).

Run: ``flock /tmp/uc-heavy.lock timeout 900 .venv/bin/python benchmarks/data_readers.py``; it prints a
markdown table (docs/benchmarks-data.md keeps the latest).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import json
import logging
import platform
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.reader_data import FORMATS, SEQ_LEN  # noqa: E402
from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset  # noqa: E402
from uc_checkpoint.data.readers import ShardReader  # noqa: E402
from uc_checkpoint.data.tracker import DataTracker  # noqa: E402

logger = logging.getLogger(__name__)

#: Samples per shard and shards per format: a few MB of data each.
SIZES: dict[str, list[int]] = {
    "npy": [20000] * 4,
    "bin": [20000] * 4,
    "parquet": [25000] * 4,
    "jsonl": [25000] * 4,
    "jsonl.gz": [25000] * 4,
    "tar": [5000] * 4,
    "hf": [25000] * 4,
}


def library_loop(fmt: str, root: Path) -> Iterator[Any]:
    """Every sample of the shards under ``root`` through the format's own library."""
    w = SEQ_LEN + 1
    if fmt in ("npy", "bin"):
        for path in sorted(root.glob(f"*.{fmt}")):
            tokens = np.load(path, mmap_mode="r") if fmt == "npy" else np.memmap(path, dtype=np.uint32, mode="r")
            for i in range(len(tokens) // w):
                yield np.asarray(tokens[i * w : (i + 1) * w], dtype=np.int64)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for path in sorted(root.glob("*.parquet")):
            for batch in pq.ParquetFile(path).iter_batches():
                yield from batch.to_pylist()
    elif fmt == "jsonl":
        for path in sorted(root.glob("*.jsonl")):
            with open(path, "rb") as f:
                yield from (json.loads(line) for line in f if line.strip())
    elif fmt == "jsonl.gz":
        for path in sorted(root.glob("*.jsonl.gz")):
            with gzip.open(path, "rb") as f:
                yield from (json.loads(line) for line in f if line.strip())
    elif fmt == "tar":
        for path in sorted(root.glob("*.tar")):
            with tarfile.open(path) as tar:
                sample: dict[str, Any] = {}
                for member in tar:
                    key, field = member.name.split(".", 1)
                    if sample and sample["__key__"] != key:
                        yield sample
                        sample = {}
                    sample.setdefault("__key__", key)
                    sample[field] = tar.extractfile(member).read()  # type: ignore[union-attr]
                if sample:
                    yield sample
    elif fmt == "hf":
        import datasets

        yield from datasets.load_from_disk(str(root))
    else:
        raise ValueError(fmt)


def reader_loop(reader: ShardReader) -> Iterator[Any]:
    for shard in reader.shards():
        yield from reader(shard, 0, shard.num_samples)


def as_list(items: list[Any]) -> list[Any]:
    return items


def tracked_loop(reader: ShardReader, shuffle: bool) -> Iterator[Any]:
    tracker = DataTracker(reader.shards(), seed=0, shuffle_within_shard=shuffle, exactly_once="off")
    loader = TrackedDataLoader(TrackedShardDataset(tracker, reader), batch_size=64, collate_fn=as_list)
    tracker.start_epoch(0)
    for batch in loader:
        yield from batch


def best_rate(make: Callable[[], Iterator[Any]], repeat: int) -> tuple[float, int]:
    """(samples per second of the fastest of ``repeat`` full passes, samples per pass)."""
    best, count = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        count = sum(1 for _ in make())
        best = min(best, time.perf_counter() - t0)
    return count / best, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--formats", nargs="*", default=sorted(FORMATS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            root = Path(tmp) / fmt.replace(".", "_")
            root.mkdir()
            FORMATS[fmt].write(root, SIZES[fmt])
            mb = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.endswith(".uc-index"))
            reader = FORMATS[fmt].reader(root)
            t0 = time.perf_counter()
            FORMATS[fmt].reader(root).shards()  # first discovery: builds and caches indexes
            index_s = time.perf_counter() - t0
            lib, n = best_rate(functools.partial(library_loop, fmt, root), args.repeat)
            direct, n2 = best_rate(functools.partial(reader_loop, reader), args.repeat)
            tracked, n3 = best_rate(functools.partial(tracked_loop, reader, False), args.repeat)
            shuffled = (
                best_rate(functools.partial(tracked_loop, reader, True), args.repeat)[0]
                if reader.random_access
                else None
            )
            assert n == n2 == n3, (fmt, n, n2, n3)
            rows.append((fmt, n, mb / 1e6, index_s, lib, direct, tracked, shuffled))
    print(f"Date: {datetime.date.today().isoformat()}; Python {platform.python_version()}, {platform.machine()}")
    print()
    print(
        "| format | samples | MB | discovery (s) | library (samples/s) | reader | tracked | tracked+shuffle | "
        "tracked / library |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fmt, n, mb, index_s, lib, direct, tracked, shuffled in rows:
        shuffle_text = f"{shuffled:,.0f}" if shuffled is not None else "n/a (sequential)"
        print(
            f"| {fmt} | {n:,} | {mb:.1f} | {index_s:.3f} | {lib:,.0f} | {direct:,.0f} | {tracked:,.0f} | "
            f"{shuffle_text} | {tracked / lib:.2f} |"
        )


if __name__ == "__main__":
    main()
