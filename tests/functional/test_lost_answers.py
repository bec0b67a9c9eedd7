"""A request the store acted on whose answer was lost (S3 over HTTP through the fault proxy): the
client's retry meets its own write. For the conditional PUT of ``.metadata`` (``If-None-Match``,
``overwrite=False``) the retry is answered ``412``, which must be read as this save's publish when
the object there is this save's, in ``dcp.save`` and ``dcp.async_save`` alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.s3_fixtures import LOST, FaultProxy
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.errors import CheckpointExistsError, rank_error
from uc_checkpoint.volumes import S3Volume


def _volume(endpoint: str, bucket: str, prefix: str) -> S3Volume:
    return S3Volume(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, max_attempts=4)


def _lose_first(proxy: FaultProxy, method: str, name: str) -> list[str]:
    """Lose the answer to the first ``method`` of a key ending in ``/name``; returns the targets it lost."""
    lost: list[str] = []

    def choose(m: str, target: str) -> str | None:
        if lost or m != method or not target.split("?")[0].endswith(f"/{name}"):
            return None
        lost.append(target)
        return LOST

    proxy.choose = choose
    return lost


def _save(sd: dict, writer: UCVolumeWriter, mode: str) -> None:
    if mode == "sync":
        dcp.save(sd, storage_writer=writer, no_dist=True)
    else:
        import torch.distributed as dist

        assert dist.is_initialized()
        dcp.async_save(sd, storage_writer=writer).result()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_conditional_publish_whose_answer_was_lost_is_published(
    s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, staging: Path, mode: str, request: pytest.FixtureRequest
) -> None:
    if mode == "async":
        request.getfixturevalue("single_rank_group")
    sd = {"w": torch.arange(1000.0), "step": 7}
    lost = _lose_first(fault_proxy, "PUT", ".metadata")
    _save(sd, UCVolumeWriter(_volume(fault_proxy.url, s3_bucket, "run/step_00000007"), overwrite=False), mode)
    assert len(lost) == 1
    puts = [r for r in fault_proxy.history if r.method == "PUT" and r.path.split("?")[0].endswith("/.metadata")]
    assert [r.header("If-None-Match") for r in puts] == ["*", "*"] and puts[1].status == 412  # the retry met it
    out = {"w": torch.zeros(1000), "step": -1}
    dcp.load(out, storage_reader=UCVolumeReader(_volume(s3_server, s3_bucket, "run/step_00000007")), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 7
    # A second job at that location is refused: the checkpoint there is published.
    fault_proxy.choose = None
    with pytest.raises(CheckpointException) as exc:
        _save(sd, UCVolumeWriter(_volume(s3_server, s3_bucket, "run/step_00000007"), overwrite=False), mode)
    assert isinstance(rank_error(exc.value), CheckpointExistsError)


@pytest.mark.parametrize("name", [".uc-claim", ".uc-save-", "complete"])
def test_a_lost_answer_to_any_other_write_of_a_save_is_retried_into_a_publish(
    s3_server: str, s3_bucket: str, fault_proxy: FaultProxy, staging: Path, name: str
) -> None:
    lost: list[str] = []

    def choose(method: str, target: str) -> str | None:
        path, _, query = target.partition("?")
        hit = (
            ("uploadId" in query and method == "POST")
            if name == "complete"
            else (method == "PUT" and path.rsplit("/", 1)[-1].startswith(name))
        )
        if lost or not hit:
            return None
        lost.append(target)
        return LOST

    fault_proxy.choose = choose
    vol = S3Volume(
        f"s3://{s3_bucket}/other/{name.strip('.')}",
        endpoint_url=fault_proxy.url,
        multipart_threshold=5 << 20,
        part_size=5 << 20,
        max_attempts=4,
    )
    sd = {"w": torch.arange(6 << 18, dtype=torch.float32)}  # 6 MiB: a multipart upload of two parts
    dcp.save(sd, storage_writer=UCVolumeWriter(vol, overwrite=False), no_dist=True)
    assert len(lost) == 1, name
    out = {"w": torch.zeros(6 << 18)}
    dcp.load(
        out, storage_reader=UCVolumeReader(_volume(s3_server, s3_bucket, f"other/{name.strip('.')}")), no_dist=True
    )
    assert torch.equal(out["w"], sd["w"])
