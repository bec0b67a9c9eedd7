"""Every save and load yields a record (bytes, files, seconds, retries) through the Python API and
logging. (The manager's save events reaching MLflow: tests/integration/test_mlflow_server.py, against a
real ``mlflow server``.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.s3_fixtures import FaultProxy
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.volumes import S3Volume


def state(value: float = 1.0) -> dict:
    return {"w": torch.full((256, 1024), value), "b": torch.arange(1000.0), "meta": {"v": value}}


def test_save_and_load_records_local(tmp_path: Path, staging: Path, caplog: pytest.LogCaptureFixture) -> None:
    dest = tmp_path / "ckpt"
    writer = UCVolumeWriter(dest, options=WriterOptions(file_size_bytes=256 << 10))
    with caplog.at_level(logging.INFO, logger="uc_checkpoint"):
        dcp.save(state(), storage_writer=writer)
    rec = writer.last_record
    on_disk = sorted(dest.glob("*.distcp"))
    assert rec is not None and rec.op == "save" and rec.rank == 0 and rec.location == str(dest)
    assert rec.files == len(on_disk) > 1 and rec.bytes == sum(p.stat().st_size for p in on_disk)
    assert 0 < rec.staging_s <= rec.total_s and 0 < rec.transfer_s <= rec.total_s and rec.retries == 0
    assert rec.throughput_mb_s > 0 and rec.as_dict()["bytes"] == rec.bytes
    assert any(r.getMessage() == rec.describe() for r in caplog.records), [r.getMessage() for r in caplog.records]

    reader = UCVolumeReader(dest)
    out = {"w": torch.zeros(256, 1024), "b": torch.zeros(1000), "meta": {"v": 0.0}}
    dcp.load(out, storage_reader=reader)
    assert reader.last_record.op == "load" and reader.last_record.bytes == rec.bytes
    assert reader.last_record.files == rec.files


def test_retries_are_counted_on_a_throttling_store(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    volume = S3Volume(f"s3://{s3_bucket}/obs", endpoint_url=fault_proxy.url, max_attempts=10)
    puts = iter(range(1000))
    fault_proxy.match = lambda method, path: method == "PUT" and ".distcp" in path and next(puts) < 3
    fault_proxy.throttle_rate = 1.0  # the first three data uploads are refused once each
    writer = UCVolumeWriter(volume, options=WriterOptions(file_size_bytes=128 << 10))
    dcp.save(state(2.0), storage_writer=writer)
    saved_throttles = fault_proxy.injected["throttle"]
    assert saved_throttles == 3
    assert writer.last_record.retries == saved_throttles  # every refused request was retried once more
    gets = iter(range(1000))
    fault_proxy.match = lambda method, path: method == "GET" and ".distcp" in path and next(gets) < 2
    fault_proxy.throttle_rate = 1.0  # the first two data GETs are refused once each
    reader = UCVolumeReader(S3Volume(f"s3://{s3_bucket}/obs", endpoint_url=fault_proxy.url, max_attempts=10))
    out = {"w": torch.zeros(256, 1024), "b": torch.zeros(1000), "meta": {"v": 0.0}}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], state(2.0)["w"])
    assert fault_proxy.injected["throttle"] - saved_throttles == 2
    assert reader.last_record.retries == 2
