"""Decisions handed over the c10d store by ``RankGroup.decided`` in a real 2-rank job (torchrun,
gloo, torchrun's TCPStore): every rank gets rank 0's decision, a decision's keys are gone from the
store once every rank has read it, and a rank 0 that never decides is a PeerTimeoutError."""

from __future__ import annotations

from tests.conftest import SCRIPTS, assert_ranks_ok, torchrun


def test_decisions_reach_every_rank_and_leave_no_keys() -> None:
    proc = torchrun(SCRIPTS / "rank_decisions.py", nproc=2, timeout=180)
    assert_ranks_ok(proc, 2, ["decisions"])
