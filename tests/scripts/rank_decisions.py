"""Run under ``torchrun --nproc_per_node=2``: decisions handed over the c10d store
(``RankGroup.decided``) reach every rank, and their keys leave the store once every rank has read them.

Usage: rank_decisions.py

- ``held``: rank 1 reads only after rank 0 saw its decision's key in the store; once rank 1 has
  read it, the key and its reader counter are gone.
- ``many``: 20 decisions in a row, every rank gets rank 0's bytes; afterwards none of their keys
  is in the store.
- ``hung``: a rank 0 that never decides is a PeerTimeoutError on rank 1 within the group's timeout,
  naming the operation and rank 0.

Prints ``RANK <r> decisions OK``.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

from uc_checkpoint.dcp import compat
from uc_checkpoint.errors import PeerTimeoutError
from uc_checkpoint.ops.ranks import RankGroup

logger = logging.getLogger("rank_decisions")


def in_store(store, key: str) -> bool:  # type: ignore[no-untyped-def]
    return bool(store.check([key]))


def held(group: RankGroup, store) -> None:  # type: ignore[no-untyped-def]
    rank = dist.get_rank()
    key = group.store_key("held")
    if rank == 1:
        dist.barrier()  # rank 0 decides first
    value = group.decided("decide held", "held", lambda: b"from rank 0")
    if rank == 0:
        assert in_store(store, key), "rank 0's decision is not in the store before rank 1 read it"
        dist.barrier()
    assert value == b"from rank 0", value
    dist.barrier()  # rank 1 has read it
    assert not in_store(store, key) and not in_store(store, f"{key}/readers"), key


def many(group: RankGroup, store) -> None:  # type: ignore[no-untyped-def]
    rank = dist.get_rank()
    for i in range(20):
        value = group.decided(f"decide {i}", f"d/{i}", lambda i=i: f"{i * 7} by {rank}".encode())
        assert value == f"{i * 7} by 0".encode(), (i, value)
    dist.barrier()
    left = [
        k
        for i in range(20)
        for k in (group.store_key(f"d/{i}"),)
        if in_store(store, k) or in_store(store, f"{k}/readers")
    ]
    assert not left, left


def hung() -> None:
    group = RankGroup(None, timedelta(seconds=1), name="hung")
    if dist.get_rank() == 0:
        return  # never decides
    started = time.monotonic()
    try:
        group.decided("receive the never-made decision", "never", lambda: b"")
    except PeerTimeoutError as exc:
        waited = time.monotonic() - started
        text = str(exc)
        assert "cannot receive the never-made decision: rank 0 did not take part" in text, text
        assert "timeout of 1 s" in text and 0.9 < waited < 20, (text, waited)
    else:
        raise AssertionError("rank 1 got a decision rank 0 never made")


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        store = compat.default_store()
        group = RankGroup(None, name="decisions")
        held(group, store)
        many(group, store)
        hung()
        dist.barrier()
        print(f"RANK {dist.get_rank()} decisions OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
