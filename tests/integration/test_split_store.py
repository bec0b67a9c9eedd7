"""A two-rank save (torchrun, gloo) whose ranks write to different S3 stores by mistake: each rank
verifies its own uploads, and the coordinator still publishes nothing, since rank 1's files are not
where the ``.metadata`` would point (see tests/scripts/split_store_save.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, torchrun
from tests.support.s3_fixtures import s3_client


@pytest.mark.slow
def test_a_rank_writing_to_another_store_publishes_nothing(tmp_path: Path, s3_server: str, s3_bucket: str) -> None:
    dest = f"s3://{s3_bucket}/split"
    proc = torchrun(SCRIPTS / "split_store_save.py", dest, nproc=2, timeout=300, env={"AWS_ENDPOINT_URL": s3_server})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for rank in (0, 1):
        assert f"RANK {rank} split REFUSED" in proc.stdout, out[-6000:]
    # rank 0's refusal names a rank-1 file missing from its store
    assert "__1_" in proc.stdout and "has None bytes on the volume" in proc.stdout, out[-6000:]
    stored = [o["Key"] for o in s3_client(s3_server).list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert "split/.metadata" not in stored and any(k.startswith("split/__0_") for k in stored), stored
