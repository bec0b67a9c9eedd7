"""The second S3 store of the benchmark (benchmarks/mounts.py localbucket_server): it comes up on a free
port in a process of its own, keeps objects on disk, its CPU reads apart, and it is gone afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.cpu import STORE_PID_ENV, process_cpu_s, store_cpu_s
from benchmarks.mounts import localbucket_available, localbucket_server, make_bucket, s3_client

pytestmark = [
    pytest.mark.skipif(localbucket_available() is not None, reason="localbucket does not import (bench extra)"),
    pytest.mark.timeout(120),
]


def test_localbucket_server_roundtrip_and_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = os.urandom(4 << 20)
    with localbucket_server(tmp_path / "data") as (url, pid):
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
    with pytest.raises(OSError):
        process_cpu_s(pid)
    assert (tmp_path / "localbucket.log").exists()
