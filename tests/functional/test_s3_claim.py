"""The publish step on S3 (real boto3 against moto over HTTP, requests seen by a proxy): each upload
is verified by its own answer, so no listing runs between the last upload and the publish; the
location's claim decides which of two overlapping saves publishes; a request of the claim that fails
(the marker's PUT, the claim's PUT, the read of the checkpoint being replaced) publishes nothing and
keeps the checkpoint that was there, and only the marker's gates the uploads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.conftest import HeldInWriteStep
from tests.support.s3_fixtures import FaultProxy
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions
from uc_checkpoint.errors import ConcurrentSaveError, rank_error
from uc_checkpoint.volumes import S3Volume


def _volume(endpoint: str, bucket: str, prefix: str) -> S3Volume:
    return S3Volume(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, max_attempts=4)


def test_no_listing_between_the_last_upload_and_the_publish(
    s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    volume = _volume(fault_proxy.url, s3_bucket, "order")
    sd = {f"t{i}": torch.full((1 << 16,), float(i)) for i in range(4)}  # 4 files of 256 KiB
    fault_proxy.reset()
    dcp.save(sd, storage_writer=UCVolumeWriter(volume, options=WriterOptions(file_size_bytes=256 << 10)))
    sent = [(r.method, r.path.split("?")[0].rsplit("/", 1)[-1], r.path) for r in fault_proxy.history]
    last_upload = max(i for i, (m, name, _) in enumerate(sent) if m == "PUT" and name.endswith(".distcp"))
    publish = next(i for i, (m, name, _) in enumerate(sent) if m == "PUT" and name == ".metadata")
    between = [(m, name) for m, name, path in sent[last_upload + 1 : publish] if "list-type" not in path]
    listings = [path for _m, _n, path in sent[last_upload + 1 : publish] if "list-type" in path]
    assert listings == [], sent
    # what remains: verifying the last upload, the claim, and whether a .metadata is there
    assert ("HEAD", ".uc-claim") in between and ("HEAD", ".metadata") in between, between
    out = {k: torch.zeros(1 << 16) for k in sd}
    dcp.load(out, storage_reader=UCVolumeReader(volume))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_of_two_overlapping_saves_the_later_claim_publishes(
    s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    url = f"s3://{s3_bucket}/both"
    reached, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        sd = {"w": torch.full((1 << 14,), 1.0), "held": HeldInWriteStep(reached, release)}
        try:
            dcp.save(sd, storage_writer=UCVolumeWriter(_volume(fault_proxy.url, s3_bucket, "both")))
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert reached.wait(60)  # the first save has claimed the location and is serialising
        time.sleep(0.2)
        dcp.save(
            {"w": torch.full((1 << 14,), 2.0)},
            storage_writer=UCVolumeWriter(_volume(fault_proxy.url, s3_bucket, "both")),
        )
    finally:
        release.set()
        thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], CheckpointException)
    err = rank_error(errors[0])
    assert isinstance(err, ConcurrentSaveError), err
    assert f"not publishing {url}: another save started at this location" in str(err)
    assert f"{url}/.uc-claim: claimed by host" in str(err) and "this one is abandoned" in str(err)
    out = {"w": torch.zeros(1 << 14)}
    dcp.load(out, storage_reader=UCVolumeReader(_volume(fault_proxy.url, s3_bucket, "both")))
    assert torch.equal(out["w"], torch.full((1 << 14,), 2.0))  # wholly the later save's
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: held"):
        dcp.load({"held": None}, storage_reader=UCVolumeReader(_volume(fault_proxy.url, s3_bucket, "both")))


def _objects(client: object, bucket: str, prefix: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])  # type: ignore[attr-defined]
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("method", "failing", "uploads_before_it"),
    [
        ("PUT", ".uc-save-", False),  # the marker: nothing may go up before it
        ("PUT", ".uc-claim", True),  # the claim's PUT: data files go up meanwhile
        ("GET", ".metadata", True),  # reading the checkpoint being replaced: the same
    ],
)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_claim_request_that_fails_publishes_nothing_and_keeps_the_old_checkpoint(
    s3_bucket: str,
    staging: Path,
    fault_proxy: FaultProxy,
    method: str,
    failing: str,
    uploads_before_it: bool,
    mode: str,
) -> None:
    from tests.support.s3_fixtures import s3_client

    client = s3_client(fault_proxy.upstream)
    n = 1 << 18  # 1 MiB tensors, one file each
    old = {f"w{i}": torch.full((n,), -1.0 - i) for i in range(4)}
    dcp.save(
        old,
        storage_writer=UCVolumeWriter(
            _volume(fault_proxy.url, s3_bucket, "ck"), options=WriterOptions(file_size_bytes=1 << 20)
        ),
    )
    before = _objects(client, s3_bucket, "ck")

    def match(request_method: str, target: str) -> bool:
        key = target.split("?")[0].rsplit("/", 1)[-1]
        if request_method == method and key.startswith(failing):
            time.sleep(0.3)  # an answer slow to come, then an error
            return True
        return False

    fault_proxy.reset()
    fault_proxy.match, fault_proxy.error_rate = match, 1.0
    new = {k: torch.full((n,), float(i)) for i, k in enumerate(old)}
    writer = UCVolumeWriter(_volume(fault_proxy.url, s3_bucket, "ck"), options=WriterOptions(file_size_bytes=1 << 20))
    with pytest.raises(CheckpointException) as ei:
        if mode == "sync":
            dcp.save(new, storage_writer=writer)
        else:
            dcp.async_save(new, storage_writer=writer).result(timeout=120)
    fault_proxy.match, fault_proxy.error_rate = None, 0.0
    assert failing in str(rank_error(ei.value)), rank_error(ei.value)
    sent = [(r.method, r.path.split("?")[0].rsplit("/", 1)[-1]) for r in fault_proxy.history]
    last_failing = max(i for i, (m, key) in enumerate(sent) if m == method and key.startswith(failing))
    data = [i for i, (_m, key) in enumerate(sent) if key.endswith(".distcp")]
    if uploads_before_it:
        # Data files went up before the failing request's last attempt came back: they did not
        # wait for it (they waited for the whole claim once, and then none was sent).
        assert data and min(data) < last_failing, sent
    else:
        assert data == [], sent
    assert ("PUT", ".metadata") not in sent, sent
    # The checkpoint that was there is whole and still the published one.
    after = _objects(client, s3_bucket, "ck")
    assert {key: after.get(key) for key in before} == before
    out = {k: torch.zeros(n) for k in old}
    dcp.load(out, storage_reader=UCVolumeReader(_volume(fault_proxy.url, s3_bucket, "ck")))
    assert all(torch.equal(out[k], old[k]) for k in old)
