"""How the requests of the checkpoint catalog grow with the number of checkpoints under a root
(issue 16's scale section): ``latest()``, a load and a save's housekeeping must not read every
checkpoint kept, ``ls`` and ``gc`` list each location once. Counted on the wire: real S3 over
HTTP (moto) through the fault proxy, which records every request."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from tests.support.s3_fixtures import FaultProxy
from uc_checkpoint import CheckpointManager, collect_garbage, list_root
from uc_checkpoint.volumes import S3Volume


def state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "meta": {"step": step}}


def _root(bucket: str, proxy: FaultProxy, n: int) -> S3Volume:
    """``n`` published checkpoints (steps 1..n) under s3://bucket/run<n>, saved without the proxy's
    counting in the way (it counts from reset())."""
    root = S3Volume(f"s3://{bucket}/run{n}", endpoint_url=proxy.url)
    manager = CheckpointManager(root, keep_last=None, async_save=False)
    for step in range(1, n + 1):
        manager.save(step, state(step))
    return root


def _requests(proxy: FaultProxy, fn) -> collections.Counter[str]:
    """Requests ``fn()`` sends, by method (GET covers listings and object reads)."""
    proxy.reset()
    fn()
    return collections.Counter(r.method for r in proxy.history)


@pytest.fixture
def roots(s3_bucket: str, fault_proxy: FaultProxy, staging: Path) -> dict[int, S3Volume]:
    return {n: _root(s3_bucket, fault_proxy, n) for n in (3, 24)}


def test_latest_and_load_send_the_same_requests_for_3_or_24_checkpoints(
    roots: dict[int, S3Volume], fault_proxy: FaultProxy
) -> None:
    sent = {}
    for n, root in roots.items():
        manager = CheckpointManager(root, async_save=False)
        sent[n] = _requests(fault_proxy, manager.latest)
        assert manager.latest() == n
        target = {"w": torch.zeros(16), "meta": {"step": -1}}
        sent[f"load{n}"] = _requests(fault_proxy, lambda m=manager, t=target: m.load(t))
        assert target["meta"]["step"] == n
    assert sent[3] == sent[24], sent
    assert sum(sent[24].values()) <= 4, sent  # LIST root, GET .metadata, LIST location (+ bucket check)
    assert sent["load3"] == sent["load24"], sent


def test_housekeeping_after_a_save_does_not_grow_with_the_checkpoints_kept(
    roots: dict[int, S3Volume], fault_proxy: FaultProxy
) -> None:
    sent = {}
    for n, root in roots.items():
        # keep_every=1 keeps everything: retention decides, deletes nothing.
        manager = CheckpointManager(root, keep_last=2, keep_every=1, async_save=False)
        manager.latest()  # a resumed run: its first save's rollback check sees nothing newer
        manager.save(n + 1, state(n + 1))
        sent[n] = _requests(fault_proxy, lambda m=manager, s=n + 2: m.save(s, state(s)))
    assert sent[3] == sent[24], sent
    assert sent[24]["HEAD"] <= 4, sent


def test_retention_looks_only_at_what_it_deletes(s3_bucket: str, fault_proxy: FaultProxy, staging: Path) -> None:
    root = _root(s3_bucket, fault_proxy, 6)
    manager = CheckpointManager(root, keep_last=2, async_save=False)
    manager.latest()
    manager.save(7, state(7))  # deletes steps 1-5, keeps 6 and 7
    assert [i.step for i in manager.list() if i.published] == [6, 7]
    sent = _requests(fault_proxy, lambda: manager.save(8, state(8)))  # deletes step 6 only
    assert [i.step for i in manager.list() if i.published] == [7, 8]
    assert sent["HEAD"] <= 6, sent  # the new step, 7, 6 and the save's own checks; not one per step


def test_ls_and_gc_list_each_location_once(roots: dict[int, S3Volume], fault_proxy: FaultProxy) -> None:
    per_checkpoint = {}
    for n, root in roots.items():
        ls = _requests(fault_proxy, lambda r=root: list_root(r))
        gc = _requests(fault_proxy, lambda r=root: collect_garbage(r, grace_s=0, include_staging=False, dry_run=True))
        per_checkpoint[n] = (ls, gc)
    (ls3, gc3), (ls24, gc24) = per_checkpoint[3], per_checkpoint[24]
    # Per checkpoint: one LIST of its location and one GET of its .metadata; no HEAD per checkpoint.
    assert ls24["GET"] - ls3["GET"] == 2 * 21, (ls3, ls24)
    assert ls24["HEAD"] == ls3["HEAD"], (ls3, ls24)
    assert gc24["GET"] - gc3["GET"] == 2 * 21, (gc3, gc24)
    assert gc24["HEAD"] == gc3["HEAD"], (gc3, gc24)
