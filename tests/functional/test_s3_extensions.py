"""DCP's stream extensions (ZStandard, a user transform) on S3 (moto over HTTP, real boto3): our
writer's checkpoints load in DCP's stock reader and stock ones in ours, ranged reads fetch each
transformed item whole and verify the stored (compressed) bytes, and a resharded partial read of a
transformed tensor is right."""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tests.conftest import assert_state_dict_equal, empty_like_state_dict, make_state_dict, staging_files
from tests.support.s3_fixtures import FaultProxy, s3_client
from tests.support.stream_extensions import EXTENSION_CASES, ZStandard, partial_read, registry
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import ReaderOptions, WriterOptions
from uc_checkpoint.format import layout
from uc_checkpoint.volumes import S3Volume

CASES = sorted(EXTENSION_CASES)


def volume(endpoint: str, bucket: str, prefix: str) -> S3Volume:
    return S3Volume(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, max_attempts=4)


def upload_dir(endpoint: str, bucket: str, prefix: str, src: Path) -> None:
    client = s3_client(endpoint)
    for path in src.iterdir():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())


def download_dir(endpoint: str, bucket: str, prefix: str, dest: Path) -> dict[str, bytes]:
    client = s3_client(endpoint)
    dest.mkdir(parents=True)
    out = {}
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        name = obj["Key"][len(prefix) + 1 :]
        out[name] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        (dest / name).write_bytes(out[name])
    return out


@pytest.mark.parametrize("case", CASES)
def test_our_s3_checkpoint_with_extensions_loads_in_ours_and_in_stock(
    case: str, s3_server: str, s3_bucket: str, tmp_path: Path, staging: Path
) -> None:
    sd = make_state_dict(21)
    vol = volume(s3_server, s3_bucket, f"ours-{case}")
    dcp.save(
        sd,
        storage_writer=UCVolumeWriter(
            vol, _extensions=EXTENSION_CASES[case](), options=WriterOptions(file_size_bytes=200_000)
        ),
    )
    for prefetch in (None, True):  # ranges (S3's default), whole files
        out = empty_like_state_dict(sd)
        dcp.load(
            out,
            storage_reader=UCVolumeReader(
                vol, _extension_registry=registry(), options=ReaderOptions(prefetch_files=prefetch)
            ),
        )
        assert_state_dict_equal(out, sd)

    stored = download_dir(s3_server, s3_bucket, f"ours-{case}", tmp_path / "copy")
    meta = pickle.loads(stored[".metadata"])
    assert all(info.transform_descriptors for info in meta.storage_data.values())
    for name, rec in layout.manifest_records(meta.uc_manifest).items():  # checksums of the stored bytes
        assert (rec.size, rec.crc32) == (len(stored[name]), f"{zlib.crc32(stored[name]):08x}")
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "copy", _extension_registry=registry()))
    assert_state_dict_equal(out, sd)
    assert staging_files(staging) == []


@pytest.mark.parametrize("case", CASES)
def test_a_stock_checkpoint_with_extensions_loads_from_s3(
    case: str, s3_server: str, s3_bucket: str, tmp_path: Path, staging: Path
) -> None:
    sd = make_state_dict(22)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock", _extensions=EXTENSION_CASES[case]()))
    upload_dir(s3_server, s3_bucket, f"stock-{case}", tmp_path / "stock")
    vol = volume(s3_server, s3_bucket, f"stock-{case}")
    for prefetch in (None, True):
        out = empty_like_state_dict(sd)
        dcp.load(
            out,
            storage_reader=UCVolumeReader(
                vol, _extension_registry=registry(), options=ReaderOptions(prefetch_files=prefetch)
            ),
        )
        assert_state_dict_equal(out, sd)


@pytest.mark.parametrize("case", CASES)
def test_a_resharded_read_of_a_transformed_tensor_on_s3(
    case: str, s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    sd = {"big": torch.randn(2048, 256), "other": torch.randn(1024, 256)}  # 2 MiB and 1 MiB
    vol = volume(fault_proxy.url, s3_bucket, f"reshard-{case}")
    dcp.save(
        sd,
        storage_writer=UCVolumeWriter(
            vol, _extensions=EXTENSION_CASES[case](), options=WriterOptions(file_size_bytes=64 << 20)
        ),
    )
    fault_proxy.reset()
    reader = UCVolumeReader(vol, _extension_registry=registry(), options=ReaderOptions(range_gap_bytes=0))
    got = partial_read(reader, "big", (300, 1100))
    assert torch.equal(got, sd["big"][300:1100])
    ranges = [r.header("Range") for r in fault_proxy.history if r.method == "GET" and ".distcp" in r.path]
    assert ranges and all(rng and rng.startswith("bytes=") for rng in ranges), ranges
    spans = [tuple(int(x) for x in rng[len("bytes=") :].split("-")) for rng in ranges]
    # The item's stored (transformed) bytes were fetched whole, though only part of it is loaded.
    meta = pickle.loads(
        s3_client(s3_server).get_object(Bucket=s3_bucket, Key=f"reshard-{case}/.metadata")["Body"].read()
    )
    (info,) = [info for index, info in meta.storage_data.items() if index.fqn == "big"]
    covered = info.offset
    for lo, hi in sorted(spans):  # inclusive byte ranges, as HTTP gives them
        if lo <= covered <= hi:
            covered = hi + 1
    assert covered >= info.offset + info.length, (spans, info)


def test_zstd_stores_fewer_bytes_on_s3(s3_server: str, s3_bucket: str, staging: Path) -> None:
    sd = {"zeros": torch.zeros(1024, 1024), "step": 3}
    plain, packed = volume(s3_server, s3_bucket, "plain"), volume(s3_server, s3_bucket, "zstd")
    dcp.save(sd, storage_writer=UCVolumeWriter(plain))
    dcp.save(sd, storage_writer=UCVolumeWriter(packed, _extensions=[ZStandard()]))
    client = s3_client(s3_server)

    def stored(prefix: str) -> int:
        objects = client.list_objects_v2(Bucket=s3_bucket, Prefix=prefix + "/").get("Contents", [])
        return sum(o["Size"] for o in objects if o["Key"].endswith(".distcp"))

    assert stored("zstd") * 50 < stored("plain")
    out = {"zeros": torch.ones(1024, 1024), "step": None}
    dcp.load(out, storage_reader=UCVolumeReader(packed))
    assert_state_dict_equal(out, sd)
