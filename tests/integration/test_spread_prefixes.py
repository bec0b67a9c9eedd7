"""Spread prefixes at scale, with real ranks: four processes under torchrun (gloo on CPU) save many
small data files to S3 (moto over HTTP) through a fault proxy that throttles each key prefix to a
request rate, as S3 does per partition. In the flat layout every rank's requests land on one
prefix and are throttled (the save still succeeds, through retries); spread over four prefixes,
each prefix carries one rank's requests and is not. The same ranks save a spread checkpoint to a
local directory, which DCP's stock ``FileSystemReader`` loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, assert_ranks_ok, torchrun
from tests.support.s3_fixtures import FaultProxy, s3_client

RANKS = 4
#: Each request is held this long by the proxy, so that one rank (4 upload workers, one request
#: each at a time) sends at most 4 / 0.1 = 40 requests/s however fast the machine is...
LATENCY_S = 0.1
#: ... and a prefix may take 50 requests/s: one rank's share never reaches it, four ranks' do (up to
#: 160/s). The rate is set low, not near one rank's cap times the ranks, because a loaded host runs
#: four ranks' Python slower than the proxy allows: at 100/s against a cap of 320/s, a busy 2-core
#: host once sent too few requests to be throttled ten times.
RATE = 50.0


@pytest.mark.slow
def test_spreading_over_prefixes_avoids_the_per_prefix_throttle(
    tmp_path: Path, s3_server: str, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    fault_proxy.latency_s = LATENCY_S
    fault_proxy.prefix_rate_limit = (None, RATE)  # a key's parent is its prefix
    proc = torchrun(
        SCRIPTS / "spread_prefixes_throttle.py",
        f"s3://{s3_bucket}/run",
        str(tmp_path / "local"),
        nproc=RANKS,
        timeout=180,
        env={"AWS_ENDPOINT_URL": fault_proxy.url, "UC_CHECKPOINT_STAGING_DIR": str(tmp_path / "staging")},
    )
    assert_ranks_ok(proc, RANKS, ("flat", "spread", "stock"))

    throttled = fault_proxy.prefix_throttled
    flat = sum(n for p, n in throttled.items() if p.startswith(f"{s3_bucket}/run/flat"))
    spread = sum(n for p, n in throttled.items() if p.startswith(f"{s3_bucket}/run/spread"))
    seconds = {m: [float(t) for t in re.findall(rf"RANK \d {m} OK ([\d.]+)", proc.stdout)] for m in ("flat", "spread")}
    print(f"503 SlowDown: flat {flat}, spread {spread}; save seconds {seconds}")  # shown with -s
    assert flat >= 10, (dict(throttled), seconds)
    assert spread <= flat // 10, (dict(throttled), seconds)
    # Each rank's data requests went to its own prefix.
    data = [p for p in fault_proxy.prefix_requests if p.startswith(f"{s3_bucket}/run/spread/")]
    assert sorted(data) == [f"{s3_bucket}/run/spread/{r}" for r in range(RANKS)]

    keys = [o["Key"] for o in s3_client(s3_server).list_objects_v2(Bucket=s3_bucket)["Contents"]]
    spread_keys = [k for k in keys if k.startswith("run/spread/") and k.endswith(".distcp")]
    assert len(spread_keys) == RANKS * 32
    for key in spread_keys:  # run/spread/<rank % 4>/__<rank>_<token>_<n>.distcp
        sub, name = key.split("/")[2:]
        assert name.startswith(f"__{sub}_"), key
    assert not [k for k in keys if k.startswith("run/flat/") and k.count("/") != 2]
    local = sorted(p.relative_to(tmp_path / "local").as_posix() for p in (tmp_path / "local").rglob("*.distcp"))
    assert {p.split("/")[0] for p in local} == {str(r) for r in range(RANKS)}
