"""Where replicated small items are saved decides how many GETs a load sends (issue 16's scale
section): with DCP's default planner they are scattered over every rank's files and each rank reads
a piece of every other rank's; with ``UCSavePlanner`` they are on rank 0 and every rank reads them
with one GET. Four real ranks (torchrun, gloo on CPU) against S3 (moto over HTTP), the GETs counted on
the wire by the fault proxy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, assert_ranks_ok, torchrun
from tests.support.s3_fixtures import FaultProxy

RANKS = 4
LARGE_FILES_PER_RANK = 2  # each rank's own tensors, read back by that rank only


def _data_gets(proxy: FaultProxy, bucket: str, mode: str) -> list[str]:
    prefix = f"/{bucket}/run/{mode}/"
    return [r.path for r in proxy.history if r.method == "GET" and r.path.startswith(prefix) and ".distcp" in r.path]


@pytest.mark.slow
def test_a_load_reads_replicated_small_items_with_one_get_per_rank(
    tmp_path: Path, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    fault_proxy.reset()
    proc = torchrun(
        SCRIPTS / "replicated_items_reads.py",
        f"s3://{s3_bucket}/run",
        nproc=RANKS,
        timeout=180,
        env={"AWS_ENDPOINT_URL": fault_proxy.url, "UC_CHECKPOINT_STAGING_DIR": str(tmp_path / "staging")},
    )
    assert_ranks_ok(proc, RANKS, ("default", "uc"))
    uc, default = _data_gets(fault_proxy, s3_bucket, "uc"), _data_gets(fault_proxy, s3_bucket, "default")
    # Each rank: its own large files, plus one GET of rank 0's small-items file (rank 0's is its own).
    assert len(uc) <= RANKS * (LARGE_FILES_PER_RANK + 1), sorted(uc)
    small_reads = [p for p in uc if "/__0_" in p and p.endswith("_0.distcp")]
    assert len(small_reads) == RANKS, sorted(uc)  # every rank read rank 0's small file once
    # DCP's placement scatters them: every rank reads a piece of other ranks' files.
    assert len(default) > len(uc), (sorted(default), sorted(uc))
