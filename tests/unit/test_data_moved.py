"""A dataset that moved is the same dataset: shards are named relative to the dataset's root and
fingerprinted by content, so a run saved while reading one directory resumes exactly on the same
files copied elsewhere (``shutil.copy2``: same bytes and mtimes; plain copies: new mtimes), for every
reader. A shard that really changed is still refused, and ``allow_dataset_change`` names every
unread sample it cannot carry over instead of dropping it. (Moving to S3:
tests/functional/test_data_moved_s3.py; forked workers: tests/integration/test_readers_resume.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.support.moved_data import CONSUMED, first_run, resume
from tests.support.reader_data import FORMATS
from tests.support.shard_edits import rewrite_with_other_samples
from uc_checkpoint.errors import DatasetMismatchError

NAMES = sorted(FORMATS)


@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("copy", [shutil.copy2, shutil.copyfile], ids=["copy2", "copyfile"])
def test_a_copied_dataset_resumes_exactly(fmt: str, copy, tmp_path: Path) -> None:
    saved, read, every = first_run(fmt, tmp_path / "data")
    assert len(read) == CONSUMED
    shutil.copytree(tmp_path / "data", tmp_path / "elsewhere", copy_function=copy)  # .uc-index files too
    shutil.rmtree(tmp_path / "data")  # nothing of the first place is left to read
    tracker, rest = resume(fmt, tmp_path / "elsewhere", saved)
    assert len(rest) == len(every) - CONSUMED == 22
    assert Counter(read + rest) == Counter(every)  # and the exactly-once digest checked out at the pass's end
    assert tracker.dataset_change is None


def test_the_saved_state_names_no_place(tmp_path: Path) -> None:
    saved, _, _ = first_run("jsonl", tmp_path / "data")
    state = json.loads(saved)
    assert [name for name, _n, _fp in state["shards"]] == ["part-000.jsonl", "part-001.jsonl", "part-002.jsonl"]
    assert str(tmp_path) not in saved
    assert all(fp.startswith("size=") and ",ends_sha256=" in fp for _name, _n, fp in state["shards"])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "bin"])
def test_a_shard_with_other_bytes_is_refused_naming_it(fmt: str, tmp_path: Path) -> None:
    saved, _, _ = first_run(fmt, tmp_path / "data")
    shutil.copytree(tmp_path / "data", tmp_path / "elsewhere")
    name = rewrite_with_other_samples(fmt, tmp_path / "elsewhere", 1, tmp_path / "scratch")
    with pytest.raises(DatasetMismatchError, match=rf"shard 1 '{name}' \(10 samples\) changed content"):
        resume(fmt, tmp_path / "elsewhere", saved)


def test_a_same_size_edit_is_refused_and_a_touch_is_not(tmp_path: Path) -> None:
    saved, read, every = first_run("jsonl", tmp_path / "data")
    shutil.copytree(tmp_path / "data", tmp_path / "edited")
    path = tmp_path / "edited" / "part-002.jsonl"
    data = path.read_bytes()
    edited = data.replace(b'"row": 5', b'"row": 6', 1)
    assert edited != data and len(edited) == len(data)
    path.write_bytes(edited)
    with pytest.raises(DatasetMismatchError, match="part-002.jsonl"):
        resume("jsonl", tmp_path / "edited", saved)

    st = (tmp_path / "data" / "part-002.jsonl").stat()
    os.utime(tmp_path / "data" / "part-002.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))
    _, rest = resume("jsonl", tmp_path / "data", saved)  # the same bytes at a new mtime: the same shard
    assert Counter(read + rest) == Counter(every)


@pytest.mark.parametrize("how", ["removed", "renamed"])
def test_allow_dataset_change_names_a_shard_it_cannot_carry_over(how: str, tmp_path: Path, caplog) -> None:
    saved, read, every = first_run("jsonl", tmp_path / "data")
    state = json.loads(saved)
    unread = {
        name: sum(e - s for i, s, e in state["remaining"] if i == k)
        for k, (name, _n, _fp) in enumerate(state["shards"])
    }
    gone = next(name for name, left in unread.items() if left)  # a shard with unread samples
    path = tmp_path / "data" / gone
    if how == "removed":
        path.unlink()
    else:
        path.rename(path.with_name("renamed-" + gone))
    with pytest.raises(DatasetMismatchError) as exc:
        resume("jsonl", tmp_path / "data", saved, allow_dataset_change=True)
    msg = str(exc.value)
    assert f"'{gone}': {unread[gone]} unread samples (the shard is gone: removed or renamed)" in msg
    assert "drop_unmapped=True" in msg

    with caplog.at_level(logging.WARNING):
        tracker, rest = resume("jsonl", tmp_path / "data", saved, allow_dataset_change=True, drop_unmapped=True)
    change = tracker.dataset_change
    assert change is not None and [(u.name, u.samples) for u in change.unmapped] == [(gone, unread[gone])]
    assert len(rest) == change.carried == len(every) - CONSUMED - unread[gone]
    assert not set(rest) & set(read)
    assert change.added == (() if how == "removed" else ("renamed-" + gone,))
    assert f"'{gone}': {unread[gone]} unread samples" in caplog.text
