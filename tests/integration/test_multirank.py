"""Two real ranks under torchrun (gloo on CPU): save with UCVolumeWriter in every DCP mode to a local
volume and to S3 (moto over HTTP), load resharded and partially (and with the stock reader where it
applies); a save against a store that refuses every upload fails cleanly on both ranks; and a save
in which only rank 1 fails (its staging deleted mid-write locally; its uploads refused on S3) gives
both ranks the error, publishes nothing and leaves the previous checkpoint loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, assert_ranks_ok, torchrun
from tests.support.s3_fixtures import FaultProxy, s3_client

LOCAL_MODES = ("sync", "thread", "process", "onefails")
S3_MODES = ("sync", "process", "fail", "onefails")


@pytest.mark.slow
def test_two_ranks_local_and_s3(tmp_path: Path, s3_server: str, s3_bucket: str, fault_proxy: FaultProxy) -> None:
    # Uploads (PUT) fail; HEAD/LIST work, so the failure comes during write_data on every rank.
    # Under onefails/ only rank 1's data files are refused.
    fault_proxy.match = lambda method, path: method == "PUT" and ("/onefails/" not in path or "/__1_" in path)
    fault_proxy.fail_all = True
    s3_root = f"s3://{s3_bucket}/multi rank"
    args: list[str] = []
    for mode in LOCAL_MODES:
        args += [str(tmp_path), mode]
    for mode in S3_MODES:
        args += [s3_root, mode]
    proc = torchrun(
        SCRIPTS / "multirank_roundtrip.py",
        *args,
        nproc=2,
        timeout=1400,
        env={
            "AWS_ENDPOINT_URL": s3_server,
            "UC_TEST_FAIL_ENDPOINT": fault_proxy.url,
            "UC_TEST_STAGING_ROOT": str(tmp_path / "staging"),
        },
    )
    assert_ranks_ok(proc, 2, (*LOCAL_MODES, *S3_MODES))
    for mode in LOCAL_MODES:
        assert (tmp_path / mode / ".metadata").is_file()  # onefails: the good checkpoint's
    stored = [o["Key"] for o in s3_client(s3_server).list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    for mode in ("sync", "process"):
        assert f"multi rank/{mode}/.metadata" in stored
    assert not [k for k in stored if k.startswith("multi rank/fail/")]
    assert fault_proxy.injected["throttle"] >= 2  # both ranks' uploads were refused
