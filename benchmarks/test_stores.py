"""The benchmark's S3 servers in processes of their own (benchmarks/servers.py): localbucket and moto
come up on a free port, serve, their CPU reads apart, and they are gone afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from benchmarks.servers import localbucket_available, localbucket_process, make_bucket, moto_process
from benchmarks.usage import STORE_PID_ENV, cpu_s, store_cpu_s
from tests.support.s3_fixtures import s3_client

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(localbucket_available() is not None, reason="localbucket does not import (bench extra)")
def test_localbucket_process_roundtrip_and_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = os.urandom(4 << 20)
    with localbucket_process(tmp_path / "data") as (url, pid):
        assert pid != os.getpid()
        make_bucket(url, "lbtest")
        client = s3_client(url)
        monkeypatch.setenv(STORE_PID_ENV, str(pid))
        before = store_cpu_s()
        for i in range(8):
            client.put_object(Bucket="lbtest", Key=f"k/{i}", Body=body)
        assert client.get_object(Bucket="lbtest", Key="k/7")["Body"].read() == body
        assert client.get_object(Bucket="lbtest", Key="k/3", Range="bytes=10-19")["Body"].read() == body[10:20]
        after = store_cpu_s()
        assert before is not None and after is not None and after > before  # 32 MiB written: > 1 tick
        assert (tmp_path / "data" / "lbtest" / "k" / "7").read_bytes() == body  # on disk, as files
    assert not os.path.exists(f"/proc/{pid}")
    with pytest.raises(psutil.NoSuchProcess):
        cpu_s(pid)
    assert (tmp_path / "localbucket.log").exists()


def test_moto_process_serves_and_stops(tmp_path: Path) -> None:
    with moto_process(tmp_path) as (url, pid):
        assert pid != os.getpid()
        make_bucket(url, "mototest")
        client = s3_client(url)
        client.put_object(Bucket="mototest", Key="k", Body=b"abc")
        assert client.get_object(Bucket="mototest", Key="k")["Body"].read() == b"abc"
        assert cpu_s(pid) > 0
    assert not psutil.pid_exists(pid)
    assert list(tmp_path.glob("moto-*.log"))
