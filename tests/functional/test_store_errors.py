"""A store that fails to answer is never evidence that a checkpoint is broken.

A real S3 server behind the fault proxy answers 503 SlowDown to, or cuts the connection of, one kind
of request: a LIST of the root (of the root itself, or the recursive one of its step locations), the
LIST of the newest checkpoint's location, the GET of its ``.metadata``, the GET of one of its data
files. ``latest()``, ``list()``, ``load()``, ``ls``,
``verify`` and ``gc`` must each raise an error that names what failed, delete nothing and never fall
back to the older step. A checkpoint that really is damaged (a data file deleted, a garbage
``.metadata``, a ``.metadata`` that disappears between listing and reading) is still skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tests.conftest import causes
from tests.support.s3_fixtures import FaultProxy, s3_client
from uc_checkpoint.cli import main as cli_main
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.errors import TransferError, UCCheckpointError, VolumeError
from uc_checkpoint.ops.garbage import collect_garbage
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.summary import list_root
from uc_checkpoint.ops.verify import verify_checkpoint
from uc_checkpoint.volumes import S3Volume

NEWEST = "step_00000002"


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "meta": {"step": step}}


def blank() -> dict:
    return {"w": torch.zeros(64, 32), "meta": {"step": -1}}


def _list_prefix(target: str) -> str | None:
    query = parse_qs(urlsplit(target).query)
    return query["prefix"][0] if "list-type" in query and "prefix" in query else None


def _key_path(target: str) -> str:
    parts = urlsplit(target)
    return "" if parts.query else parts.path


#: Request kind -> proxy predicate on (method, raw target); the root prefix is "run/", and the
#: recursive listing of its step locations lists the keys under "run/step_".
KINDS: dict[str, Callable[[str, str], bool]] = {
    "list-root": lambda m, t: m == "GET" and _list_prefix(t) in ("run/", "run/step_"),
    "list-newest": lambda m, t: m == "GET" and _list_prefix(t) == f"run/{NEWEST}/",
    "get-metadata": lambda m, t: m == "GET" and _key_path(t).endswith(f"/run/{NEWEST}/.metadata"),
    "get-data": lambda m, t: m == "GET" and f"/run/{NEWEST}/__" in _key_path(t) and _key_path(t).endswith(".distcp"),
}

#: What each operation reads: an operation whose requests include the kind must fail. list(), ls
#: and gc learn each location's files from the root's recursive listing (no HEAD or LIST per
#: checkpoint); ls and gc then GET the newest's .metadata, latest() and load list its location too.
USES = {
    "latest": {"list-root", "list-newest", "get-metadata"},
    "list": {"list-root"},
    "load": {"list-root", "list-newest", "get-metadata", "get-data"},
    "ls": {"list-root", "get-metadata"},
    "verify": {"list-newest", "get-metadata", "get-data"},
    "gc": {"list-root", "get-metadata"},
}


@dataclass
class Store:
    bucket: str
    server: str
    proxy: FaultProxy
    root: S3Volume
    manager: CheckpointManager

    def object_keys(self) -> set[str]:
        client = s3_client(self.server)
        return {o["Key"] for o in client.list_objects_v2(Bucket=self.bucket, Prefix="run/").get("Contents", [])}

    def fail(self, kind: str, fault: str) -> None:
        self.proxy.match = KINDS[kind]
        if fault == "throttle":
            self.proxy.fail_all = True
        else:
            self.proxy.cut_rate = 1.0

    def heal(self) -> None:
        self.proxy.fail_all = False
        self.proxy.cut_rate = 0.0
        self.proxy.match = None


@pytest.fixture
def store(s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, fast_retries, staging: Path) -> Store:
    """Two published checkpoints (steps 1 and 2) under s3://bucket/run, reached through the proxy with
    two attempts per request, plus leftovers gc would delete: an unpublished location (step 3) and a
    file no .metadata references in step 2."""
    root = S3Volume(f"s3://{s3_bucket}/run", endpoint_url=fault_proxy.url, max_attempts=2)
    manager = CheckpointManager(
        root, keep_last=None, list_attempts=2, list_backoff_s=0.01, staging=Staging(mode="sync")
    )
    manager.save(1, state(1))
    manager.save(2, state(2))
    client = s3_client(s3_server)
    client.put_object(Bucket=s3_bucket, Key=f"run/{NEWEST}/__0_feedface_0.distcp", Body=b"o" * 7)
    client.put_object(Bucket=s3_bucket, Key="run/step_00000003/__0_deadbeef_0.distcp", Body=b"x" * 11)
    return Store(s3_bucket, s3_server, fault_proxy, root, manager)


def _run(op: str, store: Store) -> object:
    """Run ``op`` against the store; returns its result (or raises)."""
    if op == "latest":
        return store.manager.latest()
    if op == "list":
        return [(i.step, i.published) for i in store.manager.list()]
    if op == "load":
        target = blank()
        step = store.manager.load(target)
        return step, target["meta"]["step"]
    if op == "ls":
        return [(r.step, r.state) for r in list_root(store.root)]
    if op == "verify":
        return verify_checkpoint(store.root.child(NEWEST)).problems
    if op == "gc":
        return collect_garbage(store.root, grace_s=0, include_staging=False, dry_run=False).deleted_files
    raise AssertionError(op)


@pytest.mark.parametrize("fault", ["throttle", "cut"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_store_error_is_raised_never_taken_for_damage(store: Store, kind: str, fault: str, caplog) -> None:
    before = store.object_keys()
    store.fail(kind, fault)
    for op, uses in USES.items():
        if kind not in uses:
            continue
        injected = sum(store.proxy.injected.values())
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            with pytest.raises((UCCheckpointError, CheckpointException)) as info:
                result = _run(op, store)
                pytest.fail(f"{op} under {fault} of {kind} returned {result!r} instead of raising")
        assert sum(store.proxy.injected.values()) > injected, f"{op}: the fault was never hit"
        ours = [e for e in causes(info.value) if isinstance(e, UCCheckpointError)]
        assert ours and all(isinstance(e, (TransferError, VolumeError)) for e in ours), (op, [repr(e) for e in ours])
        text = str(ours[0])
        assert f"s3://{store.bucket}/run" in text, (op, text)  # names where
        if kind != "list-root":
            assert NEWEST in text, (op, text)
        assert "skipping checkpoint" not in caplog.text, (op, caplog.text)
        assert store.object_keys() == before, f"{op} deleted {before - store.object_keys()} on a store error"
    store.heal()
    # Nothing was lost: the newest checkpoint is still the answer, and gc now does its job (so the
    # "nothing deleted" checks above could have failed).
    assert store.manager.latest() == 2
    target = blank()
    assert store.manager.load(target) == 2 and torch.equal(target["w"], state(2)["w"])
    deleted = collect_garbage(store.root, grace_s=0, include_staging=False).deleted_files
    assert sorted(d.rsplit("/", 2)[-2] for d in deleted) == [NEWEST, "step_00000003"], deleted


def test_operations_that_do_not_read_the_failing_file_still_answer(store: Store) -> None:
    # A data file that cannot be read says nothing about listings: latest() checks sizes from the
    # listing and reads no data file.
    store.fail("get-data", "throttle")
    assert store.manager.latest() == 2
    rows = [(r.step, r.state) for r in list_root(store.root, check="all")]
    assert rows == [(1, "complete"), (2, "complete"), (3, "incomplete")]


def test_cli_exits_2_with_the_store_error_not_1_or_broken(
    store: Store, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.proxy.url)
    url = f"s3://{store.bucket}/run"
    before = store.object_keys()
    for kind, argv in (
        ("get-metadata", ["ls", url]),
        ("get-metadata", ["ls", url, "--json", "--check", "all"]),
        ("get-data", ["verify", f"{url}/{NEWEST}"]),
        ("get-metadata", ["verify", f"{url}/{NEWEST}", "--json"]),
        ("get-metadata", ["gc", url, "--grace-s", "0", "--no-staging"]),
    ):
        store.fail(kind, "throttle")
        code = cli_main(argv)
        out, err = capsys.readouterr()
        assert code == 2, (argv, out, err)
        assert "error:" in err and NEWEST in err and "SlowDown" in err, (argv, err)
        assert "broken" not in out and "FAILED" not in out and "deleted" not in out, (argv, out)
        store.heal()
    assert store.object_keys() == before
    assert cli_main(["ls", url]) == 0
    assert "broken" not in capsys.readouterr().out


def test_damaged_newest_checkpoint_is_still_skipped(store: Store, caplog) -> None:
    client = s3_client(store.server)
    data = sorted(k for k in store.object_keys() if k.startswith(f"run/{NEWEST}/__0_") and "feedface" not in k)
    client.delete_object(Bucket=store.bucket, Key=data[0])
    with caplog.at_level(logging.WARNING, logger="uc_checkpoint.ops.manager"):
        assert store.manager.latest() == 1
    assert "skipping checkpoint" in caplog.text and data[0].rsplit("/", 1)[-1] in caplog.text
    rows = {r.step: r for r in list_root(store.root)}
    assert rows[2].state == "broken" and data[0].rsplit("/", 1)[-1] in (rows[2].problem or "")
    assert not verify_checkpoint(store.root.child(NEWEST)).ok
    target = blank()
    assert store.manager.load(target) == 1 and target["meta"] == {"step": 1}


def test_garbage_metadata_is_skipped_and_spared_by_gc(store: Store) -> None:
    client = s3_client(store.server)
    client.put_object(Bucket=store.bucket, Key=f"run/{NEWEST}/.metadata", Body=b"not a pickle")
    assert store.manager.latest() == 1
    rows = {r.step: r for r in list_root(store.root)}
    assert rows[2].state == "broken" and "corrupt" in (rows[2].problem or "")
    report = verify_checkpoint(store.root.child(NEWEST))
    assert not report.ok and ".metadata" in report.problems[0]
    before = {k for k in store.object_keys() if f"/{NEWEST}/" in k}
    gc = collect_garbage(store.root, grace_s=0, include_staging=False)
    assert store.root.child(NEWEST).url in gc.spared_locations
    assert {k for k in store.object_keys() if f"/{NEWEST}/" in k} == before  # nothing guessed away


def test_metadata_vanishing_between_listing_and_reading_is_not_published(store: Store) -> None:
    # The .metadata is deleted from the server the moment its GET reaches the proxy, after the
    # listing (and HEAD) saw it: what retention of another process or a re-save looks like.
    direct = s3_client(store.server)
    get_metadata = KINDS["get-metadata"]

    armed = [True]

    def vanish(method: str, target: str) -> bool:
        if armed[0] and get_metadata(method, target):
            direct.delete_object(Bucket=store.bucket, Key=f"run/{NEWEST}/.metadata")
        return False

    store.proxy.match = vanish
    assert store.manager.latest() == 1
    armed[0] = False  # the save reads its .metadata back to confirm the publish
    store.manager.save(2, state(2))  # published again
    store.manager.wait()
    armed[0] = True
    assert [(r.step, r.state) for r in list_root(store.root)][1] == (2, "incomplete")
