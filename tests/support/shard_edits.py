"""Edits of a dataset written by :mod:`tests.support.reader_data`, for the shard-identity tests:
:func:`rewrite_with_other_samples` gives a shard other bytes and as many samples (a really changed
shard under the same name), written by the format's own library."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.reader_data import FORMATS


def rewrite_with_other_samples(fmt: str, root: Path, index: int, scratch: Path) -> str:
    """Replace the ``index``-th shard file of the ``fmt`` dataset at ``root`` by a file of the same
    format and sample count but other samples (those of another shard number, written into the new
    directory ``scratch``). Returns the shard's name relative to ``root``."""
    reader = FORMATS[fmt].reader(root)
    names = reader.shard_files()
    count = reader.shards()[index].num_samples
    scratch.mkdir()
    FORMATS[fmt].write(scratch, [count, count])
    donor = FORMATS[fmt].reader(scratch).shard_files()[1 if index != 1 else 0]
    target = root / names[index]
    assert (scratch / donor).read_bytes() != target.read_bytes()
    shutil.copyfile(scratch / donor, target)
    return names[index]
