"""How the requests of the checkpoint catalog grow with the number of checkpoints under a root
(issue 16's scale section, issue 35's costs that do not grow with the root): ``latest()``, a load
and a save's housekeeping must not read every checkpoint kept; ``list()`` and ``ls`` cost the pages
of one listing of the root (plus, for ``ls``, the newest checkpoint's ``.metadata``); ``gc`` reads
every published ``.metadata`` (it must) and nothing else per checkpoint. Counted on the wire: real
S3 over HTTP (moto) through the fault proxy, which records every request. docs/operating.md states
the same counts."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from tests.support.s3_fixtures import FaultProxy, s3_client
from uc_checkpoint import CheckpointManager, collect_garbage, list_root
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.format.layout import METADATA_NAME, checkpoint_name
from uc_checkpoint.volumes import S3Volume

T = TypeVar("T")


def state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "meta": {"step": step}}


def _root(bucket: str, proxy: FaultProxy, n: int) -> S3Volume:
    """``n`` published checkpoints (steps 1..n) under s3://bucket/run<n>, saved without the proxy's
    counting in the way (it counts from reset())."""
    root = S3Volume(f"s3://{bucket}/run{n}", endpoint_url=proxy.url)
    manager = CheckpointManager(root, keep_last=None, staging=Staging(mode="sync"))
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
        manager = CheckpointManager(root, staging=Staging(mode="sync"))
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
        manager = CheckpointManager(root, keep_last=2, keep_every=1, staging=Staging(mode="sync"))
        manager.latest()  # a resumed run: its first save's rollback check sees nothing newer
        manager.save(n + 1, state(n + 1))
        sent[n] = _requests(fault_proxy, lambda m=manager, s=n + 2: m.save(s, state(s)))
    assert sent[3] == sent[24], sent
    assert sent[24]["HEAD"] <= 4, sent


def test_retention_looks_only_at_what_it_deletes(s3_bucket: str, fault_proxy: FaultProxy, staging: Path) -> None:
    root = _root(s3_bucket, fault_proxy, 6)
    manager = CheckpointManager(root, keep_last=2, staging=Staging(mode="sync"))
    manager.latest()
    manager.save(7, state(7))  # deletes steps 1-5, keeps 6 and 7
    assert [i.step for i in manager.list() if i.published] == [6, 7]
    sent = _requests(fault_proxy, lambda: manager.save(8, state(8)))  # deletes step 6 only
    assert [i.step for i in manager.list() if i.published] == [7, 8]
    assert sent["HEAD"] <= 6, sent  # the new step, 7, 6 and the save's own checks; not one per step


def _kinds(proxy: FaultProxy, fn: Callable[[], T]) -> tuple[T, collections.Counter[str]]:
    """``fn()`` and the requests it sends, by kind: ``list`` (ListObjectsV2), ``uploads``
    (ListMultipartUploads), ``get <location>/<name>`` (an object read), or the method otherwise."""
    proxy.reset()
    result = fn()
    out: collections.Counter[str] = collections.Counter()
    for r in proxy.history:
        path, _, query = r.path.partition("?")
        if r.method == "GET" and "list-type=2" in query:
            out["list"] += 1
        elif r.method == "GET" and "uploads" in query.split("&"):
            out["uploads"] += 1
        elif r.method == "GET":
            out[f"get {path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}"] += 1
        else:
            out[r.method] += 1
    return result, out


def _copies(bucket: str, server: str, proxy: FaultProxy, n: int) -> tuple[S3Volume, int]:
    """``n`` complete checkpoints (steps 1..n) under s3://bucket/many: one real save's objects
    (``.metadata``, claim, data file) copied server-side to every step location (n real saves would
    take minutes), so that each ``.metadata`` names data files that are there with their sizes.
    Returns the root (through the proxy) and the objects per checkpoint."""
    source = S3Volume(f"s3://{bucket}/source", endpoint_url=server)
    CheckpointManager(source, keep_last=None, write_pointer=False, staging=Staging(mode="sync")).save(1, state(1))
    client = s3_client(server)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="source/step_00000001/")["Contents"]]

    def copy(step: int) -> None:
        for key in keys:
            target = key.replace("source/step_00000001/", f"many/{checkpoint_name(step)}/")
            client.copy_object(Bucket=bucket, Key=target, CopySource={"Bucket": bucket, "Key": key})

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(copy, range(1, n + 1)))
    return S3Volume(f"s3://{bucket}/many", endpoint_url=proxy.url), len(keys)


@pytest.mark.parametrize("n", [10, 100, pytest.param(1000, marks=pytest.mark.slow)])
def test_list_ls_and_gc_cost_the_listing_pages_not_a_request_per_checkpoint(
    n: int, s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, staging: Path
) -> None:
    root, per_checkpoint = _copies(s3_bucket, s3_server, fault_proxy, n)
    assert per_checkpoint == 3  # .metadata, the claim, one data file
    pages = math.ceil(n * per_checkpoint / 1000)  # ListObjectsV2 returns 1,000 keys a page
    newest = f"get {checkpoint_name(n)}/{METADATA_NAME}"
    manager = CheckpointManager(root, staging=Staging(mode="sync"))

    listed, sent = _kinds(fault_proxy, manager.list)
    assert sent == {"list": pages}, sent
    assert [(i.step, i.published) for i in listed] == [(s, True) for s in range(1, n + 1)]

    rows, sent = _kinds(fault_proxy, lambda: list_root(root))
    assert sent == {"list": pages, newest: 1}, sent
    assert [r.state for r in rows] == ["published"] * (n - 1) + ["complete"]
    assert len({(r.bytes, r.files) for r in rows}) == 1  # one checkpoint copied: the sizes agree

    rows, sent = _kinds(fault_proxy, lambda: list_root(root, check="all"))
    assert sent["list"] == pages and sum(sent.values()) == pages + n, sent  # every .metadata, once
    assert [r.state for r in rows] == ["complete"] * n

    # gc: the root's own listing, the recursive one, every .metadata (what each references), and
    # one listing of the multipart uploads when it may abort them.
    for dry_run in (True, False):
        report, sent = _kinds(
            fault_proxy, lambda d=dry_run: collect_garbage(root, grace_s=0, include_staging=False, dry_run=d)
        )
        assert sent["list"] == 1 + pages, sent
        assert sent["uploads"] == (0 if dry_run else 1), sent
        assert sum(1 for k in sent if k.startswith("get ")) == n, sent
        assert sum(sent.values()) == 1 + pages + n + (0 if dry_run else 1), sent
        assert not report.deleted_files and not report.spared_locations

    latest, sent = _kinds(fault_proxy, manager.latest)
    assert latest == n and sum(sent.values()) == 3, sent  # LIST root, GET .metadata, LIST location
