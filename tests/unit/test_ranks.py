"""How the manager's ranks fail on a hung peer, in one process: the ``timeout=`` argument, which
errors count as a peer's timeout (torch's own messages), how peers are named, and that the error
crosses ranks as itself. The real hung peers are in tests/integration/test_hung_peer.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from uc_checkpoint.dcp import compat
from uc_checkpoint.errors import PeerTimeoutError, UCCheckpointError, portable_error, rebuild_error
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.options import check_timeout
from uc_checkpoint.ops.ranks import RankGroup, describe_ranks, hung_peer, timed_out


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        (None, None),
        (5, 5.0),
        (2.5, 2.5),
        (timedelta(minutes=2), 120.0),
        (np.int64(5), 5.0),  # a number from a config parsed with numpy
        (np.float32(2.0), 2.0),
        (0.001, 0.001),
    ],
)
def test_timeout_is_seconds_or_a_timedelta(given, seconds) -> None:
    checked = check_timeout(given)
    assert (checked is None) if seconds is None else checked == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("given", "error", "match"),
    [
        (True, TypeError, "timeout must be seconds .* got bool"),
        ("30", TypeError, "got str"),
        (0, ValueError, "timeout must be a finite number of seconds, at least 0.001, got 0"),
        (1e-9, ValueError, "at least 0.001, got 1e-09"),  # would be timedelta(0): no wait at all
        (timedelta(microseconds=10), ValueError, "at least 0.001"),
        (1e14, ValueError, "timeout must be at most .* seconds, got 100000000000000.0"),  # past timedelta's range
        (np.bool_(True), TypeError, "got bool"),
        (-1.0, ValueError, "got -1.0"),
        (float("inf"), ValueError, "got inf"),
        (float("nan"), ValueError, "got nan"),
        (timedelta(0), ValueError, "got datetime.timedelta\\(0\\)"),
    ],
)
def test_a_bad_timeout_is_named_when_the_manager_is_built(tmp_path: Path, given, error, match) -> None:
    with pytest.raises(error, match=match):
        CheckpointManager(str(tmp_path), timeout=given)


def test_the_given_timeout_is_the_ranks_timeout_without_a_process_group() -> None:
    assert RankGroup(None, timedelta(seconds=7)).timeout() == timedelta(seconds=7)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        # What gloo and the c10d store raise on torch 2.13 (copied from real runs).
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"), True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (dist.DistStoreError("wait timeout after 3000ms, keys: /default_pg/0//k"), True),
        # A dead peer, our own errors and other kinds are not a hung peer.
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"), False),
        (UCCheckpointError("the upload timed out"), False),
        (TimeoutError("timed out"), False),
        (ValueError("timeout must be > 0"), False),
    ],
)
def test_which_errors_are_a_peers_timeout(exc: BaseException, expected: bool) -> None:
    assert timed_out(exc) is expected


def test_a_timeout_inside_dcps_exception_counts() -> None:
    inner = RuntimeError("Timed out waiting 3000ms for send operation to complete")
    assert timed_out(CheckpointException("save", {1: (inner, None)}))


def test_peers_are_named_one_or_a_few() -> None:
    assert describe_ranks([1]) == "rank 1"
    assert describe_ranks([1, 2, 3]) == "one of ranks 1, 2, 3"
    assert describe_ranks(list(range(1, 21))) == "one of ranks 1, 2, 3, 4, 5, 6, 7, 8 and 12 more"


def test_the_error_names_the_operation_the_peer_and_the_timeout_and_crosses_ranks_as_itself() -> None:
    cause = RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    error = hung_peer("agree on preemption under /ckpt", "rank 1", timedelta(seconds=3), cause, 3.01)
    text = str(error)
    assert text.startswith("rank 0: cannot agree on preemption under /ckpt: rank 1 did not take part")
    assert "timeout of 3 s (waited 3.0 s)" in text and "Timed out waiting 3000ms" in text
    assert isinstance(error, TimeoutError) and isinstance(error, UCCheckpointError)
    portable = portable_error(error)
    assert portable is not None
    rebuilt = rebuild_error(*portable)
    assert type(rebuilt) is PeerTimeoutError and str(rebuilt) == text


def test_the_jobs_timeout_is_read_and_set_through_the_compat_module() -> None:
    # One rank on an in-process store: what init_process_group(timeout=...) set is what the manager
    # reads (a group of its own gets it, not torch's 30 minutes), and what DCP's checkpoint process
    # is given.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=7))
    try:
        assert compat.default_group_timeout() == timedelta(seconds=7)
        assert RankGroup(None).timeout() == timedelta(seconds=7)
        assert RankGroup(dist.new_group([0], backend="gloo")).timeout() == timedelta(seconds=7)
        compat.set_default_group_timeout(timedelta(seconds=9))
        assert compat.default_group_timeout() == timedelta(seconds=9)
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_every_agreement_is_local() -> None:
    # One process: rank 0's result, the flag itself, the decision made here; no store, no group.
    group = RankGroup(None, timedelta(seconds=7), name="memory://root")
    made: list[str] = []

    def make() -> bytes:
        made.append("made")
        return b"save at 10"

    assert group.decided("decide", "next_save/0", make) == b"save at 10" and made == ["made"]
    assert group.any_rank("agree on preemption", True) is True
    assert group.any_rank("agree on preemption", False) is False
    assert group.on_leader("find the latest", lambda: 3) == 3


def test_a_single_rank_job_decides_without_the_store() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=7))
    try:
        group = RankGroup(None, name="one")
        assert group.decided("decide", "k", lambda: b"v") == b"v"
        assert group.any_rank("agree", True) is True
        assert not compat.default_store().check([group.store_key("k")])  # one rank: nothing handed over
    finally:
        dist.destroy_process_group()
