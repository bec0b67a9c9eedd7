"""Upload and download throughput to S3 (moto over HTTP on 127.0.0.1), ours beside raw boto3
transfers of the same bytes, in one pytest-benchmark run::

    ./scripts/test.sh benchmarks/test_s3_throughput.py --benchmark-only

Cases (group ``s3-upload`` / ``s3-download``; ``extra_info["MB/s"]`` per case):

- ``boto3_upload_file`` / ``boto3_download_file``: the staged data files moved with boto3's own
  ``upload_file`` / ``download_file`` (s3transfer, same part size and concurrency): the floor.
- ``volume_upload`` / ``volume_download``: the same files through :class:`S3Volume` (adds the CRC-32
  of every part and block, and a checksum-verified HEAD per upload).
- ``dcp_save`` / ``dcp_load``: the whole path a user gets: ``dcp.save`` with ``UCVolumeWriter``
  (serialise to staging, upload, verify, publish ``.metadata``) and ``dcp.load`` with
  ``UCVolumeReader`` (ranged GETs, block checks, deserialise).

Size: ``UC_BENCH_MB`` (default 64 MiB of float32 in 4 tensors). moto keeps every object in memory
and shares the 2 cores with the client, so absolute figures say little about real S3; the ratio to
raw boto3 is the point.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from boto3.s3.transfer import TransferConfig

from tests.support.s3_fixtures import s3_client
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import ReaderOptions
from uc_checkpoint.volumes import S3Volume

# Quick mode (--benchmark-disable, as in CI): 4 MiB, once, so the module cannot rot.
MB = 4 if os.environ.get("UC_BENCH_QUICK") else int(os.environ.get("UC_BENCH_MB", "64"))
PART = 16 << 20
CONCURRENCY = 8
ROUNDS = int(os.environ.get("UC_BENCH_ROUNDS", "3"))


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = (MB << 20) // 4 // 4
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(4)}


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The data files a save produces, written once to local disk (DCP's own format)."""
    root = tmp_path_factory.mktemp("staged")
    dcp.save(state_dict(), checkpoint_id=str(root))
    return sorted(root.glob("*.distcp"))


def volume(endpoint: str, bucket: str, prefix: str) -> S3Volume:
    return S3Volume(
        f"s3://{bucket}/{prefix}",
        endpoint_url=endpoint,
        part_size=PART,
        multipart_threshold=PART,
        max_concurrency=CONCURRENCY,
    )


def rate(benchmark, nbytes: int) -> None:
    benchmark.extra_info["bytes"] = nbytes
    if not benchmark.enabled:
        return
    benchmark.extra_info["MB/s"] = round(nbytes / benchmark.stats.stats.median / 1e6, 1)


def total(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


@pytest.mark.benchmark(group="s3-upload")
def test_boto3_upload_file(benchmark, s3_server: str, s3_bucket: str, staged: list[Path]) -> None:
    client = s3_client(s3_server, max_pool_connections=2 * CONCURRENCY)
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)

    def run() -> None:
        prefix = uuid.uuid4().hex
        for path in staged:
            client.upload_file(str(path), s3_bucket, f"{prefix}/{path.name}", Config=config)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    rate(benchmark, total(staged))


@pytest.mark.benchmark(group="s3-upload")
def test_volume_upload(benchmark, s3_server: str, s3_bucket: str, staged: list[Path]) -> None:
    def run() -> None:
        vol = volume(s3_server, s3_bucket, uuid.uuid4().hex)
        for path in staged:
            vol.upload_file(path, path.name)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    rate(benchmark, total(staged))


@pytest.mark.benchmark(group="s3-upload")
def test_dcp_save(benchmark, s3_server: str, s3_bucket: str, staged: list[Path], tmp_path: Path) -> None:
    sd = state_dict()

    def run() -> None:
        vol = volume(s3_server, s3_bucket, uuid.uuid4().hex)
        dcp.save(sd, storage_writer=UCVolumeWriter(vol, staging_dir=tmp_path, sync_files=False))

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    rate(benchmark, total(staged))


@pytest.fixture(scope="module")
def uploaded(s3_server: str, staged: list[Path]) -> tuple[str, str]:
    """One checkpoint saved with UCVolumeWriter in its own bucket: (bucket, prefix)."""
    bucket = f"uc-bench-{uuid.uuid4().hex[:12]}"
    s3_client(s3_server).create_bucket(Bucket=bucket)
    dcp.save(state_dict(), storage_writer=UCVolumeWriter(volume(s3_server, bucket, "ck"), sync_files=False))
    return bucket, "ck"


@pytest.mark.benchmark(group="s3-download")
def test_boto3_download_file(benchmark, s3_server: str, uploaded: tuple[str, str], tmp_path: Path) -> None:
    bucket, prefix = uploaded
    client = s3_client(s3_server, max_pool_connections=2 * CONCURRENCY)
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)
    keys = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
        if o["Key"].endswith(".distcp")
    ]
    sizes = sum(
        o["Size"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
        if o["Key"].endswith(".distcp")
    )

    def run() -> None:
        for key in keys:
            client.download_file(bucket, key, str(tmp_path / "f"), Config=config)

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    rate(benchmark, sizes)


@pytest.mark.benchmark(group="s3-download")
def test_dcp_load(benchmark, s3_server: str, uploaded: tuple[str, str]) -> None:
    bucket, prefix = uploaded
    vol = volume(s3_server, bucket, prefix)
    out = {k: torch.empty_like(v) for k, v in state_dict().items()}
    nbytes = sum(s for n, s in vol.list_files().items() if n.endswith(".distcp"))

    def run() -> None:
        dcp.load(out, storage_reader=UCVolumeReader(vol, options=ReaderOptions(download_workers=CONCURRENCY)))

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    assert torch.equal(out["layer0.weight"], state_dict()["layer0.weight"])
    rate(benchmark, nbytes)


@pytest.mark.benchmark(group="s3-download")
def test_volume_download(benchmark, s3_server: str, uploaded: tuple[str, str], tmp_path: Path) -> None:
    bucket, prefix = uploaded
    vol = volume(s3_server, bucket, prefix)
    names = [n for n in vol.list_files() if n.endswith(".distcp")]
    nbytes = sum(s for n, s in vol.list_files().items() if n.endswith(".distcp"))

    def run() -> None:
        for name in names:
            vol.download_file(name, tmp_path / "f")

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    rate(benchmark, nbytes)
