"""A dataset synced from a local directory to S3 (moto over HTTP, uploaded with boto3: new ETags, no
mtimes) is the same dataset: a run saved while reading it locally resumes from ``s3://`` reading
exactly the samples it had not read, for JSON Lines, Parquet and token files; an object with other
bytes under a shard's name is refused naming the shard."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.support.moved_data import CONSUMED, first_run, resume
from tests.support.reader_data import FORMATS
from tests.support.s3_fixtures import s3_client
from tests.support.shard_edits import rewrite_with_other_samples
from uc_checkpoint.errors import DatasetMismatchError


def upload(local: Path, s3_server: str, bucket: str, prefix: str) -> None:
    """Every data file of ``local`` (not the local index caches) to ``s3://bucket/prefix/``."""
    client = s3_client(s3_server)
    for path in sorted(local.rglob("*")):
        if path.is_file() and not path.name.endswith(".uc-index"):
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "bin"])
def test_a_dataset_synced_to_s3_resumes_exactly(
    fmt: str, tmp_path: Path, s3_server: str, s3_bucket: str, staging: Path
) -> None:
    saved, read, every = first_run(fmt, tmp_path / "data")
    upload(tmp_path / "data", s3_server, s3_bucket, "synced")
    options = {"endpoint_url": s3_server, "addressing_style": "path"}
    tracker, rest = resume(fmt, f"s3://{s3_bucket}/synced", saved, volume_options=options)
    assert len(rest) == len(every) - CONSUMED == 22
    assert Counter(read + rest) == Counter(every)  # and the exactly-once digest checked out at the pass's end
    assert tracker.dataset_change is None


def test_an_object_with_other_bytes_is_refused(tmp_path: Path, s3_server: str, s3_bucket: str, staging: Path) -> None:
    saved, _, _ = first_run("jsonl", tmp_path / "data")
    name = rewrite_with_other_samples("jsonl", tmp_path / "data", 2, tmp_path / "scratch")
    assert FORMATS["jsonl"].reader(tmp_path / "data").shards()[2].num_samples == 10
    upload(tmp_path / "data", s3_server, s3_bucket, "synced")
    options = {"endpoint_url": s3_server, "addressing_style": "path"}
    with pytest.raises(DatasetMismatchError, match=rf"shard 2 '{name}' \(10 samples\) changed content"):
        resume("jsonl", f"s3://{s3_bucket}/synced", saved, volume_options=options)
