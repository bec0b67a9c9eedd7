"""Any S3-compatible store (issue 14): boto3's own checksum settings are honoured, volume options
reach every URL entry point, and a store that refuses a header or a conditional write gets an error
naming the setting to change. The store is moto behind the fault proxy, told to behave as such
stores do (400 InvalidArgument "Unsupported header 'x-amz-sdk-checksum-algorithm'", If-None-Match
ignored or refused)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import REPO
from tests.support.s3_fixtures import FaultProxy
from uc_checkpoint import CheckpointManager, UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import ReaderOptions, Staging, WriterOptions
from uc_checkpoint.errors import CheckpointExistsError, TransferError, rank_error

CHECKSUM_HEADERS = ("x-amz-sdk-checksum-algorithm", "x-amz-checksum-")
QUIET = {"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required", "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}


@pytest.fixture
def picky_store(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """moto behind a proxy that refuses checksum headers; boto3 pointed at the proxy."""
    with FaultProxy(s3_server, reject_headers=CHECKSUM_HEADERS) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        for name in QUIET:
            monkeypatch.delenv(name, raising=False)
        yield proxy


def _sd(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((300_000,), value), "b": torch.arange(10.0) + value}


def _load(location: str, **kwargs: object) -> dict[str, torch.Tensor]:
    out = {"w": torch.zeros(300_000), "b": torch.zeros(10)}
    dcp.load(out, storage_reader=UCVolumeReader(location, **kwargs), no_dist=True)
    return out


def test_boto3s_when_required_settings_are_honoured(
    picky_store: FaultProxy, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in QUIET.items():
        monkeypatch.setenv(name, value)
    url = f"s3://{s3_bucket}/b2-like/step_00000001"
    dcp.save(_sd(1.0), storage_writer=UCVolumeWriter(url, options=WriterOptions(file_size_bytes=600_000)), no_dist=True)
    for prefetch in (True, False):
        assert torch.equal(_load(url, options=ReaderOptions(prefetch_files=prefetch))["w"], torch.full((300_000,), 1.0))
    assert picky_store.injected["rejected-header"] == 0
    assert any(r.method == "PUT" for r in picky_store.history)


def test_a_store_refusing_checksum_headers_names_the_setting(picky_store: FaultProxy, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/b2-like/refused"
    with pytest.raises(BaseException) as info:
        dcp.save(_sd(2.0), storage_writer=UCVolumeWriter(url), no_dist=True)
    err = rank_error(info.value)
    assert isinstance(err, TransferError), err
    assert "AWS_REQUEST_CHECKSUM_CALCULATION=when_required" in str(err) and "checksums=False" in str(err), err
    assert picky_store.injected["rejected-header"] >= 1


@pytest.mark.parametrize("entry", ["writer-reader", "manager"])
def test_volume_options_reach_every_url_entry_point(picky_store: FaultProxy, s3_bucket: str, entry: str) -> None:
    # No environment settings: checksums=False given as a volume option on a plain URL.
    options = {"checksums": False, "addressing_style": "path"}
    if entry == "writer-reader":
        url = f"s3://{s3_bucket}/opts/step_00000003"
        dcp.save(_sd(3.0), storage_writer=UCVolumeWriter(url, volume_options=options), no_dist=True)
        assert torch.equal(_load(url, volume_options=options)["b"], torch.arange(10.0) + 3.0)
    else:
        manager = CheckpointManager(f"s3://{s3_bucket}/opts-run", volume_options=options, staging=Staging(mode="sync"))
        manager.save(4, _sd(4.0))
        assert manager.latest() == 4
        out = {"w": torch.zeros(300_000), "b": torch.zeros(10)}
        assert manager.load(out) == 4 and torch.equal(out["b"], torch.arange(10.0) + 4.0)
    assert picky_store.injected["rejected-header"] == 0


def test_the_cli_takes_volume_options(picky_store: FaultProxy, s3_bucket: str) -> None:
    CheckpointManager(
        f"s3://{s3_bucket}/cli-run", volume_options={"checksums": False}, staging=Staging(mode="sync")
    ).save(5, _sd(5.0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for verb, location in (("ls", f"s3://{s3_bucket}/cli-run"), ("verify", f"s3://{s3_bucket}/cli-run/step_00000005")):
        ok = subprocess.run(
            [sys.executable, "-m", "uc_checkpoint.cli", verb, location, "-o", "checksums=False"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=180,
        )
        assert ok.returncode == 0, (verb, ok.stderr[-2000:])
    assert "complete" in ok.stdout or "OK" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "uc_checkpoint.cli", "ls", f"s3://{s3_bucket}/cli-run", "-o", "nonsense=1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=180,
    )
    assert bad.returncode == 2 and "nonsense" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_a_store_refusing_conditional_writes_names_the_setting(
    s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FaultProxy(s3_server, conditional_writes="reject") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        url = f"s3://{s3_bucket}/no-conditions/step_00000001"
        with pytest.raises(BaseException) as info:
            dcp.save(_sd(6.0), storage_writer=UCVolumeWriter(url, overwrite=False), no_dist=True)
        err = rank_error(info.value)
        assert isinstance(err, TransferError) and "If-None-Match" in str(err) and "overwrite=True" in str(err), err
        # The default (overwrite=True) sends no condition and works.
        dcp.save(_sd(6.0), storage_writer=UCVolumeWriter(url), no_dist=True)
        assert torch.equal(_load(url)["b"], torch.arange(10.0) + 6.0)
        assert proxy.injected["rejected-condition"] >= 1


def test_a_store_ignoring_conditional_writes_still_keeps_a_published_checkpoint(
    s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FaultProxy(s3_server, conditional_writes="ignore") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        url = f"s3://{s3_bucket}/ignores-conditions/step_00000001"
        dcp.save(_sd(7.0), storage_writer=UCVolumeWriter(url, overwrite=False), no_dist=True)
        with pytest.raises(BaseException) as info:
            dcp.save(_sd(8.0), storage_writer=UCVolumeWriter(url, overwrite=False), no_dist=True)
        assert isinstance(rank_error(info.value), CheckpointExistsError)
        assert torch.equal(_load(url)["b"], torch.arange(10.0) + 7.0)


def test_half_the_settings_still_names_the_fix(
    picky_store: FaultProxy, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the request side set: the HEAD that verifies an upload still asks for the checksum and
    # gets a bodiless 400.
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    with pytest.raises(BaseException) as info:
        dcp.save(_sd(9.0), storage_writer=UCVolumeWriter(f"s3://{s3_bucket}/half/x"), no_dist=True)
    err = rank_error(info.value)
    assert isinstance(err, TransferError) and "AWS_RESPONSE_CHECKSUM_VALIDATION=when_required" in str(err), err


def test_the_cli_reads_boolean_words(picky_store: FaultProxy, s3_bucket: str) -> None:
    CheckpointManager(
        f"s3://{s3_bucket}/words", volume_options={"checksums": False}, staging=Staging(mode="sync")
    ).save(1, _sd(1.0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for word in ("false", "no", "off"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "uc_checkpoint.cli",
                "verify",
                f"s3://{s3_bucket}/words/step_00000001",
                "-o",
                f"checksums={word}",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=180,
        )
        assert proc.returncode == 0, (word, proc.stderr[-2000:])
