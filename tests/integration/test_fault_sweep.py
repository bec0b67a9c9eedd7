"""Every request of a save, every fault: a systematic search instead of one bug report at a time.

A counting run records the requests a small save sends to S3 through the fault proxy (a multipart
data file, the marker, the claim, the ``.metadata``, and for :class:`CheckpointManager` also its
listing, pointer and retention). Then, for every request and each of four faults, the save runs once
with that one request faulted:

* ``503``: a ``503 SlowDown`` answer (the store did nothing);
* ``reset``: the connection is reset before the store sees the request (for a request without a
  body the store acts and the answer is cut off: S3 clients see both);
* ``lost``: the store acts on the request, and its answer never comes back;
* ``outage``: every request from that one on is answered ``503`` until the save ends.

Each run is classified: either the save succeeded and its checkpoint loads with the values saved; or
it raised one of our errors naming what failed, nothing half-published is visible (the location
loads the old checkpoint or none), ``latest()`` is unchanged, and the same save retried without
faults succeeds. No run may hang, load wrong values, report a failure for a checkpoint it
published, or leave a location that a retry cannot save to. Requests are told apart by what they do
(method, file kind, S3 operation) and their order among requests of that kind, so threads that
interleave differently from run to run still fault the same request.
"""

from __future__ import annotations

import collections
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.s3_fixtures import CUT, LOST, THROTTLE, FaultProxy
from uc_checkpoint import CheckpointManager, UCCheckpointError, UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.errors import rank_error
from uc_checkpoint.volumes import S3Volume

pytestmark = pytest.mark.slow

MIB = 1 << 20
FAULTS = ("503", "reset", "lost", "outage")


def request_kind(method: str, target: str) -> str:
    """What a request does, without the names that change from save to save (tokens, upload ids):
    e.g. ``"PUT data part"``, ``"PUT .metadata"``, ``"GET location list"``."""
    parts = urlsplit(target)
    name = unquote(parts.path).rstrip("/").rsplit("/", 1)[-1]
    query = parse_qs(parts.query, keep_blank_values=True)
    if name.endswith(".distcp"):
        what = "data"
    elif name.startswith(".uc-save-"):
        what = "marker"
    elif re.fullmatch(r"step_\d+", name) or "list-type" in query or "uploads" in query and method == "GET":
        what = "location"
    else:
        what = name
    if "list-type" in query:
        op = "list"
    elif "uploads" in query:
        op = "start-multipart" if method == "POST" else "list-multipart"
    elif "partNumber" in query:
        op = "part"
    elif "uploadId" in query:
        op = "complete-multipart" if method == "POST" else "abort-multipart"
    else:
        op = ""
    return f"{method} {what} {op}".strip()


@dataclass
class Plan:
    """Which request to fault: the ``nth`` (from 0) of kind ``kind``, with ``fault``."""

    kind: str
    nth: int
    fault: str


class Injector:
    """The proxy's ``choose`` hook: records every request's kind, and faults the one a
    :class:`Plan` names (an outage: that one and every later one)."""

    def __init__(self, plan: Plan | None) -> None:
        self.plan = plan
        self.seen: list[str] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.outage = False
        self.hit = False

    def __call__(self, method: str, target: str) -> str | None:
        kind = request_kind(method, target)
        self.seen.append(kind)
        nth = self.counts[kind]
        self.counts[kind] += 1
        if self.outage:
            return THROTTLE
        plan = self.plan
        if plan is None or plan.kind != kind or plan.nth != nth:
            return None
        self.hit = True
        if plan.fault == "outage":
            self.outage = True
            return THROTTLE
        return {"503": THROTTLE, "reset": CUT, "lost": LOST}[plan.fault]

    def stop(self) -> None:
        """No more faults (the run is over; clean-ups and checks go through unfaulted)."""
        self.plan = None
        self.outage = False


def sweep(counting: list[str]) -> Iterator[Plan]:
    """Every (request, fault) of a counting run's request kinds, in order."""
    nth: collections.Counter[str] = collections.Counter()
    for kind in counting:
        for fault in FAULTS:
            yield Plan(kind, nth[kind], fault)
        nth[kind] += 1


def state(step: int) -> dict[str, Any]:
    """A save of one multipart data file (6 MiB in two parts) and a scalar."""
    return {"w": torch.arange(6 * MIB // 4, dtype=torch.float32) + step, "step": step}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(6 * MIB // 4, dtype=torch.float32), "step": -1}


def volume(endpoint: str, url: str) -> S3Volume:
    """Small parts, one request at a time, few fast attempts: a short, ordered sweep."""
    return S3Volume(
        url,
        endpoint_url=endpoint,
        multipart_threshold=5 * MIB,
        part_size=5 * MIB,
        max_concurrency=1,
        max_attempts=3,
        connect_timeout=5,
        read_timeout=10,
    )


def loaded(endpoint: str, url: str) -> dict[str, Any] | None:
    """The checkpoint at ``url`` loaded straight from the store (no proxy); None if none is published."""
    vol = volume(endpoint, url)
    if vol.size(".metadata") is None:
        return None
    out = blank()
    dcp.load(out, storage_reader=UCVolumeReader(vol), no_dist=True)
    return out


def assert_is(out: dict[str, Any] | None, step: int, where: str) -> None:
    assert out is not None, f"{where}: nothing published"
    assert out["step"] == step and torch.equal(out["w"], state(step)["w"]), f"{where}: wrong values"


@dataclass
class Tally:
    """How the runs of one sweep ended."""

    succeeded: int = 0
    refused: int = 0
    errors: collections.Counter[str] | None = None

    def __post_init__(self) -> None:
        self.errors = collections.Counter()

    def failed(self, exc: BaseException, plan: Plan) -> None:
        self.refused += 1
        assert self.errors is not None
        self.errors[f"{plan.fault} on {plan.kind}: {type(exc).__name__}"] += 1


def run_sweep(
    proxy: FaultProxy,
    save_once: Callable[[Injector, str], BaseException | None],
    check: Callable[[str, BaseException | None, Plan], None],
    name: str,
) -> Tally:
    """Count the requests of one save, then run it once per (request, fault) and check each run."""
    counting = Injector(None)
    proxy.choose = counting
    assert save_once(counting, "count") is None
    kinds = list(counting.seen)
    tally = Tally()
    for i, plan in enumerate(sweep(kinds)):
        injector = Injector(plan)
        proxy.choose = injector
        tag = f"r{i}"
        error = save_once(injector, tag)
        injector.stop()
        assert injector.hit, f"{plan} was never sent (the counting run saw {kinds})"
        if error is None:
            tally.succeeded += 1
        else:
            inner = rank_error(error)
            assert isinstance(inner, UCCheckpointError), f"{plan}: not one of our errors: {inner!r}"
            assert str(inner), plan
            tally.failed(inner, plan)
        check(tag, error, plan)
    proxy.choose = None
    print(
        f"\n{name}: {len(kinds)} requests ({', '.join(f'{k} x{n}' for k, n in collections.Counter(kinds).items())}); "
        f"{len(kinds) * len(FAULTS)} faulted runs: {tally.succeeded} succeeded, {tally.refused} raised:"
    )
    for what, n in sorted((tally.errors or {}).items()):
        print(f"  {what} x{n}")
    return tally


@pytest.mark.parametrize("over", [None, 6], ids=["new-location", "over-a-checkpoint"])
def test_every_request_of_a_writer_save_with_each_fault(
    s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, staging: Path, fast_retries: float, over: int | None
) -> None:
    # At a new location with overwrite=False (the conditional PUT of .metadata); over a published
    # checkpoint with overwrite=True (the replaced .metadata read, then its data files deleted).
    base = f"s3://{s3_bucket}/sweep-{uuid.uuid4().hex[:6]}"
    overwrite = over is not None

    def writer(endpoint: str, url: str) -> UCVolumeWriter:
        return UCVolumeWriter(volume(endpoint, url), overwrite=overwrite, options=WriterOptions(upload_workers=1))

    def save_once(injector: Injector, tag: str) -> BaseException | None:
        url = f"{base}/{tag}"
        if over is not None:
            plan, injector.plan = injector.plan, None  # the checkpoint there, saved unfaulted
            dcp.save(state(over), storage_writer=writer(s3_server, url), no_dist=True)
            injector.plan = plan
        try:
            dcp.save(state(7), storage_writer=writer(fault_proxy.url, url), no_dist=True)
        except BaseException as exc:  # noqa: BLE001 - classified by the caller
            return exc
        return None

    def check(tag: str, error: BaseException | None, plan: Plan) -> None:
        url = f"{base}/{tag}"
        if error is None:
            assert_is(loaded(s3_server, url), 7, f"{plan} succeeded")
            return
        if over is None:
            assert loaded(s3_server, url) is None, f"{plan}: raised {rank_error(error)!r} but published"
        else:
            assert_is(loaded(s3_server, url), over, f"{plan}: raised {rank_error(error)!r}; the old checkpoint")
        dcp.save(state(7), storage_writer=writer(s3_server, url), no_dist=True)  # the same save, no faults
        assert_is(loaded(s3_server, url), 7, f"{plan} retried")

    run_sweep(fault_proxy, save_once, check, f"UCVolumeWriter(overwrite={overwrite})")


def test_every_request_of_a_manager_save_with_each_fault(
    s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, staging: Path, fast_retries: float, single_rank_group: Any
) -> None:
    base = f"s3://{s3_bucket}/sweep-manager-{uuid.uuid4().hex[:6]}"

    def manager(endpoint: str, root: str) -> CheckpointManager:
        return CheckpointManager(
            volume(endpoint, root),
            keep_last=1,
            list_attempts=2,
            list_backoff_s=0.01,
            writer=WriterOptions(upload_workers=1),
        )

    def prepared(root: str) -> None:
        direct = manager(s3_server, root)
        direct.save(1, state(1)).result()  # the checkpoint retention deletes once step 2 is published
        direct.wait()

    def save_once(injector: Injector, tag: str) -> BaseException | None:
        root = f"{base}/{tag}"
        plan, injector.plan = injector.plan, None
        prepared(root)  # step 1, unfaulted
        injector.seen.clear()
        injector.counts.clear()
        injector.plan = plan
        try:
            mgr = manager(fault_proxy.url, root)
            mgr.save(2, state(2))
            mgr.wait()
        except BaseException as exc:  # noqa: BLE001 - classified by the caller
            return exc
        return None

    def check(tag: str, error: BaseException | None, plan: Plan) -> None:
        root = f"{base}/{tag}"
        direct = manager(s3_server, root)
        if error is None:
            assert direct.latest() == 2, f"{plan} succeeded but latest() is {direct.latest()}"
            out = blank()
            assert direct.load(out) == 2
            assert_is(out, 2, f"{plan} succeeded")
            return
        assert direct.latest() == 1, f"{plan}: raised {rank_error(error)!r}, latest() is {direct.latest()}"
        assert loaded(s3_server, f"{root}/step_00000002") is None, f"{plan}: raised but step 2 is published"
        direct.save(2, state(2)).result()  # the same save, no faults
        direct.wait()
        assert direct.latest() == 2
        out = blank()
        direct.load(out)
        assert_is(out, 2, f"{plan} retried")

    run_sweep(fault_proxy, save_once, check, "CheckpointManager(keep_last=1)")
