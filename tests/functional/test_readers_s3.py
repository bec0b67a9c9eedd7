"""Every shard reader against a real S3 server (moto over HTTP, real boto3), through the counting
proxy: discovery gives the same shards (names and content fingerprints) as the local files; a
reader in a fresh process (a pickled copy, as a DataLoader worker gets) reading a slice from the
middle of a shard sends only ranged GETs, and the bytes they ask for are a small part of the file."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from tests.support.reader_data import FORMATS, plain
from tests.support.s3_fixtures import FaultProxy, s3_client

# Samples per shard: big enough that the slice read is a small part of the file.
SIZES = {"hf": [8000, 8000], "parquet": [4000, 60000]}  # pyarrow reads a Parquet footer as the last 64 KiB
DEFAULT_SIZES = [4000, 9000]


def fetched_bytes(proxy: FaultProxy) -> tuple[int, int]:
    """(GET requests, bytes their Range headers asked for); a GET without a range fails the test."""
    gets = [r for r in proxy.history if r.method == "GET" and "list-type" not in r.path]
    total = 0
    for record in gets:
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", record.header("Range") or "")
        assert match, f"a GET of a whole object: {record.path}"
        total += int(match.group(2)) - int(match.group(1)) + 1
    return len(gets), total


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_middle_slice_reads_only_its_bytes(
    fmt: str, tmp_path: Path, s3_bucket: str, fault_proxy: FaultProxy, staging: Path
) -> None:
    local = tmp_path / "data"
    local.mkdir()
    sizes = SIZES.get(fmt, DEFAULT_SIZES)
    expected = FORMATS[fmt].write(local, sizes)
    client = s3_client(fault_proxy.url)
    for path in sorted(local.iterdir()):
        if not path.name.endswith(".uc-index"):
            client.upload_file(str(path), s3_bucket, f"ds/{fmt}/{path.name}")
    options = {"endpoint_url": fault_proxy.url, "addressing_style": "path"}
    reader = FORMATS[fmt].reader(f"s3://{s3_bucket}/ds/{fmt}", volume_options=options)
    shards = reader.shards()
    assert [s.num_samples for s in shards] == [len(e) for e in expected]
    assert shards == FORMATS[fmt].reader(local).shards()  # the same names and content fingerprints

    worker = pickle.loads(pickle.dumps(reader))  # no open files or caches: as a DataLoader worker starts
    shard = shards[1]
    size = (local / shard.name).stat().st_size
    fault_proxy.reset()
    middle = shard.num_samples // 2
    got = [plain(s) for s in worker(shard, middle, middle + 20)]
    assert got == expected[1][middle : middle + 20]
    requests, nbytes = fetched_bytes(fault_proxy)
    assert requests >= 1
    assert nbytes < size // 4, f"{fmt}: read {nbytes} bytes of a {size}-byte shard for 20 samples"
    if worker.random_access:
        fault_proxy.reset()
        picks = [3, shard.num_samples - 1, middle]
        assert [plain(s) for s in worker.read_indices(shard, picks)] == [expected[1][i] for i in picks]
        requests, nbytes = fetched_bytes(fault_proxy)
        assert nbytes < size // 2, f"{fmt}: read {nbytes} bytes of a {size}-byte shard for 3 samples"
