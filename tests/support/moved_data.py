"""A run that reads part of an epoch from a dataset in one place and resumes from the same files in
another (a copied directory, an S3 prefix), for the shard-identity tests.

:func:`first_run` writes three shards of ten samples with the format's own library, reads
:data:`CONSUMED` samples through a :class:`TrackedDataLoader` (main process) and returns the saved
state as the JSON a checkpoint holds, the samples read and every sample; :func:`resume` builds a
fresh reader, tracker and loader on a location, loads the state and reads the rest of the epoch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.reader_data import FORMATS, plain
from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset
from uc_checkpoint.data.tracker import DataTracker

SIZES = [10, 10, 10]
CONSUMED = 8
BATCH = 4


def identity(sample: Any) -> str:
    """What a sample is, as a string."""
    return repr(plain(sample))


def as_list(items: list[Any]) -> list[Any]:
    return items


def loader_for(tracker: DataTracker, reader: Any) -> TrackedDataLoader:
    return TrackedDataLoader(
        TrackedShardDataset(tracker, reader, transform=identity), batch_size=BATCH, num_workers=0, collate_fn=as_list
    )


def first_run(fmt: str, root: Path) -> tuple[str, list[str], list[str]]:
    """Write the dataset at ``root`` (a new directory), read :data:`CONSUMED` samples of epoch 0 and
    return ``(saved state as JSON, samples read, every sample of the dataset)``."""
    root.mkdir()
    every = [repr(s) for shard in FORMATS[fmt].write(root, SIZES) for s in shard]
    reader = FORMATS[fmt].reader(root)
    tracker = DataTracker(reader.shards(), seed=11)
    tracker.start_epoch(0)
    read: list[str] = []
    for batch in loader_for(tracker, reader):
        read += batch
        if len(read) == CONSUMED:
            break
    return json.dumps(tracker.global_state([tracker.local_state()])), read, every


def resume(fmt: str, location: str | Path, saved: str, **tracker_options: Any) -> tuple[DataTracker, list[str]]:
    """A new job on ``location``: its own reader and tracker, the saved state loaded, the rest of
    epoch 0 read. Returns the tracker and the samples read."""
    volume_options = tracker_options.pop("volume_options", None)
    reader = FORMATS[fmt].reader(location, volume_options=volume_options)
    tracker = DataTracker(reader.shards(), seed=0, **tracker_options)
    tracker.load_global_state(json.loads(saved))
    tracker.start_epoch(0)
    rest: list[str] = []
    for batch in loader_for(tracker, reader):
        rest += batch
    return tracker, rest
