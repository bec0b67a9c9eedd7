"""The publish step on S3 (real boto3 against moto over HTTP, requests seen by a proxy): each upload
is verified by its own answer, so no listing runs between the last upload and the publish; the
location's claim decides which of two overlapping saves publishes."""

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
    dcp.save(sd, storage_writer=UCVolumeWriter(volume, file_size_bytes=256 << 10))
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
