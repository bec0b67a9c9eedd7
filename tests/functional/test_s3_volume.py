"""S3 volumes against a real S3 server (moto over HTTP, real boto3), with faults injected at the
HTTP level by a proxy; and fsspec volumes (memory://, file://)."""

from __future__ import annotations

import base64
import pickle
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.conftest import assert_state_dict_equal, cause, empty_like_state_dict, make_state_dict, staging_files
from tests.support.s3_fixtures import FaultProxy, s3_client
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import ReaderOptions, WriterOptions
from uc_checkpoint.errors import CheckpointExistsError, CorruptCheckpointError, TransferError, VolumeError
from uc_checkpoint.volumes import FsspecVolume, S3Volume, open_volume

# Every character class S3 keys allow that URLs and shells treat specially.
AWKWARD_PREFIX = "runs/ä ö+%20=&;@$,:'!(x)*#?~^|`{}[]<>/step 0001"


def s3_volume(endpoint: str, bucket: str, prefix: str, **kw) -> S3Volume:
    kw.setdefault("max_attempts", 4)
    return S3Volume(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, **kw)


def keys(endpoint: str, bucket: str) -> dict[str, dict]:
    client = s3_client(endpoint)
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = obj
    return out


def save_and_load(volume, sd: dict, **reader_kw) -> dict:
    dcp.save(sd, storage_writer=UCVolumeWriter(volume, options=WriterOptions(file_size_bytes=200_000)))
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=UCVolumeReader(volume, options=ReaderOptions(**reader_kw)))
    return out


@pytest.mark.parametrize("prefetch", [False, True], ids=["ranges", "whole-files"])
def test_round_trip_with_awkward_keys(s3_server: str, s3_bucket: str, staging: Path, prefetch: bool) -> None:
    volume = s3_volume(s3_server, s3_bucket, AWKWARD_PREFIX)
    sd = make_state_dict(1)
    out = save_and_load(volume, sd, prefetch_files=prefetch)
    assert_state_dict_equal(sd, out)
    stored = keys(s3_server, s3_bucket)
    assert f"{AWKWARD_PREFIX}/.metadata" in stored
    data = [k for k in stored if k.endswith(".distcp")]
    assert len(data) >= 2 and all(k.startswith(AWKWARD_PREFIX + "/__0_") for k in data)
    assert staging_files(staging) == []


def test_endpoint_and_credentials_from_the_environment(
    s3_server: str, s3_bucket: str, staging: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    url = f"s3://{s3_bucket}/env/ck"
    assert isinstance(open_volume(url), S3Volume)
    sd = make_state_dict(2, n=2)
    out = save_and_load(url, sd)
    assert_state_dict_equal(sd, out)
    assert "env/ck/.metadata" in keys(s3_server, s3_bucket)


def test_a_checkpoint_id_url_keeps_the_endpoint_of_the_volume_the_writer_was_built_from(
    s3_server: str, s3_bucket: str, staging: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The environment's endpoint is a closed port: a checkpoint_id opened as a bare URL went there
    # (the volume's endpoint, credentials and part sizes were dropped for boto3's defaults).
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    root = s3_volume(s3_server, s3_bucket, "root", max_attempts=1)
    url = f"s3://{s3_bucket}/elsewhere/ck"
    sd = make_state_dict(2, n=2)
    dcp.save(sd, storage_writer=UCVolumeWriter(root), checkpoint_id=url)
    assert "elsewhere/ck/.metadata" in keys(s3_server, s3_bucket)
    out = empty_like_state_dict(sd)
    dcp.load(out, storage_reader=UCVolumeReader(root), checkpoint_id=url)
    assert_state_dict_equal(sd, out)
    carried = root.with_location(url)
    assert carried is not None and carried.endpoint_url == s3_server and carried.url == url
    assert root.with_location("/tmp/x") is None and root.with_location("gs://b/x") is None


def test_multipart_upload_is_verified_against_the_store_checksum(s3_server: str, s3_bucket: str, staging: Path) -> None:
    volume = s3_volume(s3_server, s3_bucket, "mp", multipart_threshold=5 << 20, part_size=5 << 20)
    sd = {"big": torch.randn(3 << 20), "small": torch.arange(7)}  # 12 MiB: three parts
    dcp.save(sd, storage_writer=UCVolumeWriter(volume))
    client = s3_client(s3_server)
    data_keys = [k for k in keys(s3_server, s3_bucket) if k.endswith(".distcp")]
    assert len(data_keys) == 2, data_keys  # the small tensor has a file of its own
    data_key = max(data_keys, key=lambda k: client.head_object(Bucket=s3_bucket, Key=k)["ContentLength"])
    head = client.head_object(Bucket=s3_bucket, Key=data_key, ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-3")  # really a multipart upload
    assert head.get("ChecksumCRC32")  # the store checked and kept a CRC-32
    meta = UCVolumeReader(volume).load_metadata()
    record = meta.uc_manifest["files"][data_key.rsplit("/", 1)[1]]
    assert record["size"] == head["ContentLength"]
    assert len(record["blocks"]) == 4 * -(-record["size"] // (4 << 20))  # a CRC-32 per 4 MiB block
    out = {"big": torch.zeros(3 << 20), "small": torch.zeros(7, dtype=torch.int64)}
    dcp.load(out, storage_reader=UCVolumeReader(volume, options=ReaderOptions(range_chunk_bytes=1 << 20)))
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"])
    assert not client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")


def test_multipart_parts_carry_the_staged_files_part_crcs_and_botocore_computes_none(
    s3_server: str, s3_bucket: str, tmp_path: Path, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from botocore import httpchecksum

    computed: list[int] = []
    update = httpchecksum.Crc32Checksum.update

    def counted(self: Any, chunk: bytes) -> None:  # counts botocore's own CRC-32 work, changes nothing
        computed.append(len(chunk))
        update(self, chunk)

    monkeypatch.setattr(httpchecksum.Crc32Checksum, "update", counted)
    volume = s3_volume(fault_proxy.url, s3_bucket, "parts", multipart_threshold=5 << 20, part_size=5 << 20)
    staged = tmp_path / "big.distcp"
    payload = torch.randn(3 << 20).numpy().tobytes() + b"tail"  # 12 MiB + 4 bytes: three parts
    staged.write_bytes(payload)
    fault_proxy.reset()
    record = volume.upload_file(staged, "big.distcp")
    parts = sorted(
        (r for r in fault_proxy.history if r.method == "PUT" and "partNumber=" in r.path),
        key=lambda r: int(r.path.split("partNumber=")[1].split("&")[0]),
    )
    assert len(parts) == 3
    for number, part in enumerate(parts):
        body = payload[number * (5 << 20) : (number + 1) * (5 << 20)]
        sent = part.header("x-amz-checksum-crc32")
        assert sent and base64.b64decode(sent) == zlib.crc32(body).to_bytes(4, "big"), number
    assert computed == []  # every part's CRC-32 came from the staged file's digest
    head = s3_client(s3_server).head_object(Bucket=s3_bucket, Key="parts/big.distcp", ChecksumMode="ENABLED")
    assert head["ContentLength"] == record.size == len(payload)
    assert s3_client(s3_server).get_object(Bucket=s3_bucket, Key="parts/big.distcp")["Body"].read() == payload


def test_a_file_below_the_multipart_threshold_is_one_put_the_store_checks(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    volume = s3_volume(fault_proxy.url, s3_bucket, "single")
    # One 16 MiB tensor: its file is 16 MiB plus a few KiB of archive records, below 32 MiB.
    sd = {"w": torch.randn(4 << 20)}
    fault_proxy.reset()
    dcp.save(sd, storage_writer=UCVolumeWriter(volume))
    data = [r for r in fault_proxy.history if ".distcp" in r.path]
    assert [r.method for r in data] == ["PUT"], [(r.method, r.path) for r in data]  # no parts, no HEAD
    (put,) = data
    record = next(iter(UCVolumeReader(volume).load_metadata().uc_manifest["files"].values()))
    sent = put.header("x-amz-checksum-crc32")
    assert sent and base64.b64decode(sent).hex() == record["crc32"]  # the staged file's own CRC-32
    (key,) = [k for k in keys(s3_server, s3_bucket) if k.startswith("single/") and k.endswith(".distcp")]
    head = s3_client(s3_server).head_object(Bucket=s3_bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ContentLength"] == record["size"] > 16 << 20 and head["ChecksumCRC32"] == sent
    fault_proxy.reset()
    out = {"w": torch.zeros(4 << 20)}
    dcp.load(out, storage_reader=UCVolumeReader(volume))
    assert torch.equal(out["w"], sd["w"])
    # The file's few KiB past 16 MiB come with the 16 MiB GET, not in a GET of their own.
    gets = [r for r in fault_proxy.history if r.method == "GET" and ".distcp" in r.path]
    assert len(gets) == 1, [r.header("Range") for r in gets]


def test_a_publish_proven_by_its_etag_is_not_read_back(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    """A store that keeps no CRC-32 (here: none asked for) still answers a PUT with the MD5 of what
    it stored as its ETag: that proves the .metadata, with no GET of it after the PUT."""
    from uc_checkpoint.volumes.s3 import _etag_is_md5_of

    assert s3_volume(fault_proxy.url, s3_bucket, "etag-x", checksums=False).publish_bytes("x", b"some bytes") is True
    volume = s3_volume(fault_proxy.url, s3_bucket, "etag", checksums=False)
    assert not _etag_is_md5_of('"0123456789abcdef0123456789abcdef-2"', b"some bytes")  # multipart / KMS form
    assert not _etag_is_md5_of(None, b"")
    fault_proxy.reset()
    dcp.save({"w": torch.arange(10.0)}, storage_writer=UCVolumeWriter(volume))
    meta = [
        (r.method, r.header("x-amz-checksum-crc32"))
        for r in fault_proxy.history
        if r.path.split("?")[0].endswith("/.metadata")
    ]
    # no CRC-32 sent, and no read-back (a HEAD before it: is a .metadata published there?)
    assert meta == [("HEAD", None), ("PUT", None)], meta
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=UCVolumeReader(volume))
    assert torch.equal(out["w"], torch.arange(10.0))


def test_partial_load_fetches_only_the_needed_ranges(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    volume = s3_volume(fault_proxy.url, s3_bucket, "partial")
    sd = {f"t{i}": torch.randn(256, 1024) for i in range(8)}  # 1 MiB each, 8 MiB in one file
    dcp.save(sd, storage_writer=UCVolumeWriter(volume, options=WriterOptions(file_size_bytes=64 << 20)))
    fault_proxy.reset()
    out = {"t5": torch.zeros(256, 1024)}
    dcp.load(out, storage_reader=UCVolumeReader(volume, options=ReaderOptions(range_gap_bytes=0)))
    assert torch.equal(out["t5"], sd["t5"])
    ranges = [r.header("Range") for r in fault_proxy.history if r.method == "GET" and ".distcp" in r.path]
    assert ranges and all(rng and rng.startswith("bytes=") for rng in ranges), ranges
    spans = [tuple(int(x) for x in rng[len("bytes=") :].split("-")) for rng in ranges]
    fetched = sum(hi - lo + 1 for lo, hi in spans)
    # The one tensor (1 MiB) widened to its 4 MiB checksum blocks at most: never the 8 MiB file.
    assert 1 << 20 <= fetched <= 4 << 20, spans


def test_overwrite_false_uses_a_conditional_put(s3_server: str, s3_bucket: str, staging: Path) -> None:
    volume = s3_volume(s3_server, s3_bucket, "once")
    volume.publish_bytes("marker", b"first", overwrite=False)
    # The store itself refuses the second PUT (If-None-Match: *): no check-then-write race.
    with pytest.raises(CheckpointExistsError, match=r"s3://.*/once/marker"):
        volume.publish_bytes("marker", b"second", overwrite=False)
    assert volume.read_bytes("marker") == b"first"
    volume.delete("marker")
    dcp.save(make_state_dict(3, n=1), storage_writer=UCVolumeWriter(volume, overwrite=False))
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(4, n=1), storage_writer=UCVolumeWriter(volume, overwrite=False))
    assert isinstance(cause(ei), CheckpointExistsError)
    out = empty_like_state_dict(make_state_dict(3, n=1))
    dcp.load(out, storage_reader=UCVolumeReader(volume))
    assert_state_dict_equal(make_state_dict(3, n=1), out)


@pytest.mark.parametrize("prefetch", [False, True], ids=["ranges", "whole-files"])
def test_corrupted_missing_and_truncated_objects_are_named(
    s3_server: str, s3_bucket: str, staging: Path, prefetch: bool
) -> None:
    volume = s3_volume(s3_server, s3_bucket, f"bad-{prefetch}")
    sd = make_state_dict(5)
    dcp.save(sd, storage_writer=UCVolumeWriter(volume, options=WriterOptions(file_size_bytes=200_000)))
    client = s3_client(s3_server)
    data_keys = sorted(k for k in keys(s3_server, s3_bucket) if k.endswith(".distcp") and k.startswith(volume.prefix))

    def load() -> BaseException:
        with pytest.raises(CheckpointException) as ei:
            dcp.load(
                empty_like_state_dict(sd),
                storage_reader=UCVolumeReader(volume, options=ReaderOptions(prefetch_files=prefetch)),
            )
        return cause(ei)

    # One flipped byte, same size: only a checksum can tell.
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=data_keys[0])["Body"].read())
    original = bytes(body)
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=data_keys[0], Body=bytes(body))
    err = load()
    assert isinstance(err, CorruptCheckpointError) and data_keys[0] in str(err) and "checksum" in str(err)

    client.put_object(Bucket=s3_bucket, Key=data_keys[0], Body=original[: len(original) // 3])
    err = load()
    assert isinstance(err, CorruptCheckpointError) and data_keys[0] in str(err)

    client.delete_object(Bucket=s3_bucket, Key=data_keys[0])
    err = load()
    assert isinstance(err, CorruptCheckpointError) and data_keys[0] in str(err) and "missing" in str(err)


def test_missing_bucket_and_checkpoint_are_clear_errors(s3_server: str, staging: Path) -> None:
    volume = s3_volume(s3_server, "no-such-bucket-here", "x")
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(n=1), storage_writer=UCVolumeWriter(volume))
    assert isinstance(cause(ei), VolumeError) and "no-such-bucket-here" in str(cause(ei))
    with pytest.raises(CheckpointException) as ei:
        dcp.load(make_state_dict(n=1), storage_reader=UCVolumeReader(volume))
    assert isinstance(cause(ei), VolumeError) and "bucket 'no-such-bucket-here' does not exist" in str(cause(ei))
    with pytest.raises(VolumeError, match="no bucket"):
        S3Volume("s3:///prefix")


def test_flaky_store_still_saves_and_loads(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    volume = s3_volume(
        fault_proxy.url,
        s3_bucket,
        "flaky",
        max_attempts=10,
        multipart_threshold=5 << 20,
        part_size=5 << 20,
        read_timeout=5,
    )
    sd = {**make_state_dict(6), "big": torch.randn(3 << 20)}
    fault_proxy.throttle_rate, fault_proxy.error_rate, fault_proxy.cut_rate = 0.15, 0.1, 0.1
    # Faults are drawn per request: a round of a few dozen requests may miss one kind, so rounds go
    # on (each one checked) until every kind has hit at least once.
    for _ in range(6):
        out = save_and_load(volume, sd, range_chunk_bytes=1 << 20)
        assert_state_dict_equal(sd, out)
        if {"throttle", "error", "cut"} <= set(fault_proxy.injected):
            break
    assert {"throttle", "error", "cut"} <= set(fault_proxy.injected), fault_proxy.injected
    assert not s3_client(s3_server).list_multipart_uploads(Bucket=s3_bucket).get("Uploads")


def test_failing_store_gives_a_clear_error_and_publishes_nothing(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    volume = s3_volume(
        fault_proxy.url, s3_bucket, "dead", max_attempts=2, multipart_threshold=5 << 20, part_size=5 << 20
    )
    good = make_state_dict(7, n=1)
    dcp.save(good, storage_writer=UCVolumeWriter(volume))  # a previous good checkpoint
    # Every part upload fails from now on; the rest of S3 works, so s3transfer can abort.
    fault_proxy.match = lambda method, path: method == "PUT" and ("partNumber=" in path or ".distcp" in path)
    fault_proxy.fail_all = True
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"big": torch.randn(3 << 20)}, storage_writer=UCVolumeWriter(volume))
    err = cause(ei)
    assert isinstance(err, TransferError) and "s3://" in str(err) and "dead/" in str(err)
    client = s3_client(s3_server)
    assert not client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")  # aborted
    fault_proxy.fail_all = False
    out = empty_like_state_dict(good)
    dcp.load(out, storage_reader=UCVolumeReader(volume))  # still the previous checkpoint
    assert_state_dict_equal(good, out)
    assert staging_files(staging) == []


def test_unreachable_store_no_metadata(s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy) -> None:
    volume = s3_volume(fault_proxy.url, s3_bucket, "down", max_attempts=2)
    fault_proxy.fail_all = True
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(8, n=1), storage_writer=UCVolumeWriter(volume))
    assert isinstance(cause(ei), (VolumeError, TransferError)) and s3_bucket in str(cause(ei))
    assert not keys(s3_server, s3_bucket)
    assert fault_proxy.requests >= 2


def test_pickling_s3_volume(s3_server: str, s3_bucket: str) -> None:
    volume = s3_volume(s3_server, s3_bucket, "p")
    volume.list_files()  # builds the client
    clone = pickle.loads(pickle.dumps(volume))
    assert clone.url == volume.url and clone._client is None
    with pytest.raises(VolumeError, match="client_factory"):
        pickle.dumps(S3Volume(f"s3://{s3_bucket}/p", client=s3_client(s3_server)))
    writer = UCVolumeWriter(volume)
    assert pickle.loads(pickle.dumps(writer)).volume.url == volume.url


def test_abort_incomplete_uploads_only_at_this_location(s3_server: str, s3_bucket: str) -> None:
    client = s3_client(s3_server)
    client.create_multipart_upload(Bucket=s3_bucket, Key="loc/__0_dead_0.distcp")
    client.create_multipart_upload(Bucket=s3_bucket, Key="loc/sub/__0_other_0.distcp")
    assert s3_volume(s3_server, s3_bucket, "loc").abort_incomplete_uploads() == 1
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])]
    assert left == ["loc/sub/__0_other_0.distcp"]


# ---- fsspec --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_fsspec_round_trip_and_overwrite_false(kind: str, tmp_path: Path, staging: Path) -> None:
    url = f"memory://uc-{tmp_path.name}/ck 1" if kind == "memory" else f"file://{tmp_path}/fs ck"
    volume = FsspecVolume(url)
    sd = make_state_dict(9)
    out = save_and_load(volume, sd)
    assert_state_dict_equal(sd, out)
    out2 = empty_like_state_dict(sd)
    dcp.load(out2, storage_reader=UCVolumeReader(volume, options=ReaderOptions(prefetch_files=True)))
    assert_state_dict_equal(sd, out2)
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(10), storage_writer=UCVolumeWriter(volume, overwrite=False))
    assert isinstance(cause(ei), CheckpointExistsError)
    with pytest.raises(CheckpointExistsError):
        volume.publish_bytes(".metadata", b"x", overwrite=False)
    assert staging_files(staging) == []


def test_fsspec_corrupt_file_is_named(tmp_path: Path, staging: Path) -> None:
    volume = FsspecVolume(f"memory://uc-corrupt-{tmp_path.name}")
    sd = make_state_dict(11)
    dcp.save(sd, storage_writer=UCVolumeWriter(volume, options=WriterOptions(file_size_bytes=200_000)))
    name = sorted(n for n in volume.list_files() if n.endswith(".distcp"))[0]
    data = bytearray(volume.read_bytes(name) or b"")
    data[100] ^= 0x10
    volume.fs.pipe_file(volume._path(name), bytes(data))
    with pytest.raises(CheckpointException) as ei:
        dcp.load(empty_like_state_dict(sd), storage_reader=UCVolumeReader(volume))
    assert isinstance(cause(ei), CorruptCheckpointError) and name in str(cause(ei))


def test_unknown_scheme_is_a_volume_error() -> None:
    with pytest.raises(VolumeError, match="nosuchproto"):
        open_volume("nosuchproto://x/y")


def _data_requests(method: str, path: str) -> bool:
    return ".distcp" in path and method in ("PUT", "POST", "GET")


def test_slow_store_read_timeouts_are_retried(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    # A store that sometimes answers nothing for longer than the client waits: each such request
    # times out and is retried; the checkpoint saves and loads intact.
    volume = s3_volume(fault_proxy.url, s3_bucket, "slow", max_attempts=10, read_timeout=1)
    sd = make_state_dict(11)
    seen = {"PUT": 0, "GET": 0}

    def first_uploads_and_downloads(method: str, path: str) -> bool:
        # The first two data-file PUTs and GETs hang; the retries and everything else go through.
        if ".distcp" not in path or method not in seen:
            return False
        seen[method] += 1
        return seen[method] <= 2

    fault_proxy.stall_rate, fault_proxy.stall_s = 1.0, 4.0
    fault_proxy.match = first_uploads_and_downloads
    out = save_and_load(volume, sd)
    assert_state_dict_equal(sd, out)
    assert fault_proxy.injected["stall"] == 4, fault_proxy.injected


def test_hung_store_fails_clearly_and_keeps_the_previous_checkpoint(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy
) -> None:
    volume = s3_volume(fault_proxy.url, s3_bucket, "hung", max_attempts=2, read_timeout=1)
    good = make_state_dict(12, n=1)
    dcp.save(good, storage_writer=UCVolumeWriter(volume))
    fault_proxy.match = _data_requests
    # Every data upload hangs. A client that waited the stall out would see its request relayed and
    # the save succeed, so the error below (a read timeout) proves it gave up on its own.
    fault_proxy.stall_rate, fault_proxy.stall_s = 1.0, 120.0
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state_dict(13, n=1), storage_writer=UCVolumeWriter(volume))
    err = cause(ei)
    assert isinstance(err, TransferError) and "s3://" in str(err) and "hung/" in str(err), repr(err)
    assert "timeout" in repr(err.__cause__).lower() or "timed out" in str(err).lower(), repr(err.__cause__)
    fault_proxy.stall_rate = 0.0
    out = empty_like_state_dict(good)
    dcp.load(out, storage_reader=UCVolumeReader(volume))  # the previous checkpoint, intact
    assert_state_dict_equal(good, out)


@pytest.mark.parametrize("prefetch", [False, True], ids=["ranges", "whole-files"])
def test_partial_objects_on_load_are_named_never_wrong_tensors(
    s3_server: str, s3_bucket: str, staging: Path, fault_proxy: FaultProxy, prefetch: bool
) -> None:
    # Every data GET returns half the body and closes: retried, then a clear error naming the file.
    volume = s3_volume(fault_proxy.url, s3_bucket, "partial", max_attempts=2)
    sd = make_state_dict(14, n=2)
    dcp.save(sd, storage_writer=UCVolumeWriter(volume))
    fault_proxy.match = lambda method, path: method == "GET" and ".distcp" in path
    fault_proxy.cut_rate = 1.0
    out = empty_like_state_dict(sd)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(out, storage_reader=UCVolumeReader(volume, options=ReaderOptions(prefetch_files=prefetch)))
    err = cause(ei)
    assert isinstance(err, (TransferError, CorruptCheckpointError)), repr(err)
    assert ".distcp" in str(err) and "partial/" in str(err), str(err)
    assert fault_proxy.injected["cut"] >= 2


def test_a_new_volumes_client_reads_no_service_model_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every save with a new UCVolumeWriter makes a new S3Volume and so a new client: botocore's JSON
    # service models must be decoded once per process, not once per client (~0.1 s of CPU each).
    import botocore.loaders

    S3Volume("s3://bucket-a/x", endpoint_url="http://127.0.0.1:9").client  # noqa: B018 - builds it
    reads: list[str] = []
    original = botocore.loaders.JSONFileLoader.load_file

    def counting(self, file_path, *args, **kwargs):
        reads.append(str(file_path))
        return original(self, file_path, *args, **kwargs)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counting)
    client = S3Volume("s3://bucket-b/y", endpoint_url="http://127.0.0.1:9", max_attempts=3).client
    assert client.meta.config.retries["total_max_attempts"] == 3  # its own settings, not a shared client
    assert reads == []


def test_ranges_are_received_into_the_callers_buffer_over_one_connection(s3_server: str, s3_bucket: str) -> None:
    """read_range_into gives read_range's bytes (a range ending at the file's end included), reports
    a range past the end as truncated, and leaves each connection fit for the next request."""
    import os

    volume = s3_volume(s3_server, s3_bucket, "into")
    data = os.urandom((3 << 20) + 17)
    volume.client.put_object(Bucket=s3_bucket, Key=volume.key("f"), Body=data)
    for start, end in ((0, 1 << 20), (5, 70_000), (1 << 20, len(data)), (len(data) - 1, len(data))):
        out = bytearray(end - start)
        volume.read_range_into("f", start, memoryview(out))
        assert bytes(out) == data[start:end] == volume.read_range("f", start, end), (start, end)
        cut = (end - start) // 3
        parts = [bytearray(cut), bytearray(0), bytearray(end - start - cut)]
        volume.read_range_into("f", start, [memoryview(p) for p in parts])
        assert b"".join(parts) == data[start:end], (start, end)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        volume.read_range_into("f", len(data) - 10, memoryview(bytearray(20)))
    with pytest.raises(CorruptCheckpointError, match="missing|does not exist"):
        volume.read_range_into("nope", 0, memoryview(bytearray(4)))
    for _ in range(30):
        volume.read_range_into("f", 1 << 20, memoryview(bytearray(1 << 20)))
    # botocore's urllib3 pool: a body read past urllib3 must still return its connection.
    pools = volume.client._endpoint.http_session._manager.pools
    assert sum(pools[k].num_connections for k in pools.keys()) <= 2


def test_only_whole_object_gets_are_checked_by_botocore_too(s3_server: str, s3_bucket: str) -> None:
    """A ranged read, even one covering the whole object (the answer then carries the stored
    CRC-32), is checked against the manifest's block CRC-32s alone, not a second time by botocore;
    a whole-object GET (``.metadata``) keeps botocore's check."""
    import os

    volume = s3_volume(s3_server, s3_bucket, "rangecheck")
    data = os.urandom((1 << 20) + 5)
    volume.client.put_object(Bucket=s3_bucket, Key=volume.key("f"), Body=data, ChecksumAlgorithm="CRC32")
    bodies: list[str] = []  # botocore wraps a body it checks in a StreamingChecksumBody
    volume.client.meta.events.register(
        "after-call.s3.GetObject", lambda parsed, **_: bodies.append(type(parsed["Body"]).__name__)
    )
    out = bytearray(len(data))
    volume.read_range_into("f", 0, memoryview(out))
    assert bytes(out) == data and volume.read_range("f", 0, len(data)) == data
    assert volume.read_bytes("f") == data
    assert bodies == ["StreamingBody", "StreamingBody", "StreamingChecksumBody"], bodies


def test_bodies_cut_off_while_received_into_a_buffer_are_fetched_again(
    s3_server: str, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    import os

    data = os.urandom(2 << 20)
    s3_client(s3_server).put_object(Bucket=s3_bucket, Key="cut/f", Body=data)
    volume = s3_volume(fault_proxy.url, s3_bucket, "cut", max_attempts=10)
    fault_proxy.cut_rate = 0.5
    for _ in range(6):
        out = bytearray(1 << 20)
        volume.read_range_into("f", 1 << 20, memoryview(out))
        assert bytes(out) == data[1 << 20 :]
        # Scattered over several buffers (a tensor's memory among them), a retry refills them all.
        parts = [bytearray(n) for n in (5, (1 << 19) - 5, 1 << 19)]
        volume.read_range_into("f", 1 << 20, [memoryview(p) for p in parts])
        assert b"".join(parts) == data[1 << 20 :]
    assert "cut" in fault_proxy.injected and volume.retries > 0


@pytest.mark.parametrize("sign_payload", [None, False])
def test_payload_signing_on_plain_http_is_a_choice(
    s3_bucket: str, fault_proxy: FaultProxy, staging: Path, sign_payload: bool | None
) -> None:
    """botocore signs every body (a SHA-256 of each byte) over plain HTTP; sign_payload=False
    sends UNSIGNED-PAYLOAD instead, still with the body's CRC-32, and the checkpoint round-trips."""
    volume = s3_volume(
        fault_proxy.url, s3_bucket, f"sign-{sign_payload}", sign_payload=sign_payload, multipart_threshold=5 << 20
    )
    sd = {**make_state_dict(3), "big": torch.randn(2 << 20)}  # 8 MiB: a multipart upload too
    fault_proxy.reset()
    out = save_and_load(volume, sd)
    assert_state_dict_equal(sd, out)
    bodies = [r for r in fault_proxy.history if r.method == "PUT"]
    hashes = {r.header("x-amz-content-sha256") for r in bodies}
    if sign_payload is False:
        assert hashes <= {"UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"}, hashes
    else:
        assert not hashes & {"UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"}, hashes
    assert any(r.header("x-amz-checksum-crc32") or r.header("x-amz-trailer") for r in bodies)
    assert pickle.loads(pickle.dumps(volume)).sign_payload is sign_payload
    with pytest.raises(VolumeError, match="sign_payload"):
        S3Volume("s3://bucket/p", sign_payload="no")  # type: ignore[arg-type]


def test_volumes_with_the_same_settings_share_one_client(
    s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job builds a writer, and so a volume, for every save: the second volume must not build a
    client (and open connections) again; other settings, other credentials or a factory must."""
    from uc_checkpoint.volumes.s3_client import CLIENTS

    first = s3_volume(s3_server, s3_bucket, "ckpt/step-1")
    assert first.list_files() == {}
    second = s3_volume(s3_server, s3_bucket, "ckpt/step-2")
    assert second.client is first.client
    # Anything the client is built from gives another client.
    assert s3_volume(s3_server, s3_bucket, "ckpt/step-3", max_attempts=3).client is not first.client
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key")
    assert s3_volume(s3_server, s3_bucket, "ckpt/step-4").client is not first.client
    monkeypatch.undo()
    assert s3_volume(s3_server, s3_bucket, "ckpt/step-5").client is first.client
    built: list[object] = []

    def factory() -> object:
        built.append(s3_client(s3_server))
        return built[-1]

    a = S3Volume(f"s3://{s3_bucket}/f/1", client_factory=factory)
    b = S3Volume(f"s3://{s3_bucket}/f/2", client_factory=factory)
    assert a.client is built[0] and b.client is built[1]  # a factory's clients are the caller's own
    # A volume crossing to another process takes a client there.
    clone = pickle.loads(pickle.dumps(second))
    assert clone.client is first.client  # same process: the cached one
    assert clone.list_files() == {}
    CLIENTS.clear()
    assert s3_volume(s3_server, s3_bucket, "ckpt/step-6").client is not first.client


def test_the_client_cache_is_bounded_and_per_process() -> None:
    import multiprocessing

    from uc_checkpoint.volumes.s3_client import ClientCache

    cache = ClientCache(size=2)
    made: list[object] = []

    def build() -> object:
        made.append(_FakeClient())
        return made[-1]

    a = cache.get(("a",), build)[0]
    assert cache.get(("a",), build)[0] is a
    cache.get(("b",), build)
    cache.get(("a",), build)  # a is now the most recently used
    cache.get(("c",), build)  # b goes
    assert cache.get(("a",), build)[0] is a and len(made) == 3
    # Our handlers go onto each client once, when it is built, not on every volume that takes it.
    hooks = ["after-call.s3", "before-call.s3.GetObject", "before-parameter-build.s3.UploadPart"]
    assert all(c.registered == hooks for c in made)
    cache.get(("b",), build)
    assert len(made) == 4
    # A forked child never uses its parent's client (its connections are the parent's).
    ctx = multiprocessing.get_context("fork")
    answers = ctx.SimpleQueue()
    child = ctx.Process(target=_client_ids_in_child, args=(cache, ("a",), answers))  # fork: not pickled
    child.start()
    child.join(60)
    in_child, inherited = answers.get()
    assert inherited == [] and in_child != id(a)  # the child starts with none of its parent's clients


class _FakeClient:
    """Stands for a boto3 client in the cache's own tests: only its event registry is used, and it
    keeps the names of the events our handlers were registered for."""

    def __init__(self) -> None:
        self.meta = SimpleNamespace(events=SimpleNamespace(register=self._register))
        self.registered: list[str] = []

    def _register(self, event: str, handler: object) -> None:
        self.registered.append(event)


def _client_ids_in_child(cache: Any, settings: tuple, answers: Any) -> None:
    """In a forked child: the id of the client ``cache`` gives for ``settings``, and the ids of the
    clients the child found in it."""
    parents = [id(client) for client, _ in cache._entries.values()]
    answers.put((id(cache.get(settings, _FakeClient)[0]), parents))


class _ViewRecordingVolume(S3Volume):
    """An S3 volume that notes the memory every ranged read is received into."""

    addresses: list[tuple[int, int]]

    def read_range_into(self, name: str, start: int, out: Any, **kwargs: Any) -> None:
        import ctypes

        for view in [out] if isinstance(out, memoryview) else list(out):
            if len(view):
                self.addresses.append((ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view)))
        super().read_range_into(name, start, out, **kwargs)


@pytest.mark.parametrize("layout_matches", [True, False], ids=["in-place", "reassembled"])
def test_large_tensors_are_received_straight_into_their_targets(
    s3_server: str, s3_bucket: str, staging: Path, monkeypatch: pytest.MonkeyPatch, layout_matches: bool
) -> None:
    """A ranged load receives a large tensor's bytes into the tensor itself (no buffer, no copy);
    the archive records around it are checked once they arrive. Where they are not the layout
    expected, the item is put back together and decoded the slow way, to the same values."""
    from uc_checkpoint.dcp.item_codec import ItemCodec

    sd = {"big": torch.randn(512, 1024), "mid": torch.randn(300, 300), "small": torch.randn(16), "step": 7}
    volume = _ViewRecordingVolume(f"s3://{s3_bucket}/in-place", endpoint_url=s3_server)
    volume.addresses = []
    dcp.save(sd, storage_writer=UCVolumeWriter(volume))
    if not layout_matches:
        monkeypatch.setattr(ItemCodec, "received_into", lambda self, data, target: False)
    out = {"big": torch.zeros(512, 1024), "mid": torch.zeros(300, 300), "small": torch.zeros(16), "step": 0}
    dcp.load(out, storage_reader=UCVolumeReader(volume))
    assert_state_dict_equal(sd, out)
    for name in ("big", "mid"):  # both above the codec's small-tensor size
        target = out[name]
        assert (target.data_ptr(), target.numel() * 4) in volume.addresses, name
    assert all(addr != out["small"].data_ptr() for addr, _ in volume.addresses)  # small ones decode from the buffer


def test_targets_that_share_memory_load_through_the_buffer(s3_server: str, s3_bucket: str, staging: Path) -> None:
    """Two plan tensors that are views of one buffer (or one tensor under two keys) are not
    received in place: parallel reads would write one's bytes under the other's blocks while they
    are verified, a false 'fails its checksum'. Found by a fresh-clone tester."""
    x, y = torch.randn(512, 512), torch.randn(512, 512)
    volume = S3Volume(f"s3://{s3_bucket}/shared-targets", endpoint_url=s3_server)
    dcp.save({"a": x, "b": y, "big": torch.randn(512, 512)}, storage_writer=UCVolumeWriter(volume))
    base = torch.zeros(768, 512)
    alone = torch.zeros(512, 512)
    dcp.load({"a": base[:512], "b": base[256:], "big": alone}, storage_reader=UCVolumeReader(volume))
    assert torch.equal(base[:256], x[:256]) and torch.equal(base[512:], y[256:])
    assert torch.equal(base[256:512], x[256:]) or torch.equal(base[256:512], y[:256])  # one of the two, whole
    one = torch.zeros(512, 512)
    dcp.load({"a": one, "b": one}, storage_reader=UCVolumeReader(volume))  # one tensor under two keys
    assert torch.equal(one, x) or torch.equal(one, y)


def _upload_in_child(volume: S3Volume, staged: Path, answers: Any) -> None:
    volume.upload_file(staged, "child.bin")
    answers.put(volume.read_bytes("child.bin") == staged.read_bytes())


@pytest.mark.parametrize("explicit_client", [False, True], ids=["built", "given"])
def test_a_forked_child_uploads_through_a_transfer_manager_of_its_own(
    s3_server: str, s3_bucket: str, tmp_path: Path, explicit_client: bool
) -> None:
    import multiprocessing

    kw: dict[str, Any] = {"client": s3_client(s3_server)} if explicit_client else {"endpoint_url": s3_server}
    volume = S3Volume(f"s3://{s3_bucket}/fork", multipart_threshold=5 << 20, part_size=5 << 20, **kw)
    staged = tmp_path / "f.bin"
    staged.write_bytes(torch.randn(3 << 20).numpy().tobytes())  # 12 MiB: a multipart upload
    volume.upload_file(staged, "parent.bin")  # the parent's transfer manager and its threads exist
    ctx = multiprocessing.get_context("fork")
    answers = ctx.SimpleQueue()
    child = ctx.Process(target=_upload_in_child, args=(volume, staged, answers))  # fork: not pickled
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child's multipart upload never finished")
    assert child.exitcode == 0 and answers.get() is True


def test_a_child_forked_while_a_client_is_built_gets_its_own(s3_server: str, s3_bucket: str) -> None:
    """A fork while another thread builds a shared client (holding the cache's lock) must not leave
    the child waiting forever, and a volume inherited through fork never uses its parent's client
    (its connections belong to the parent). Found by a fresh-clone tester."""
    import multiprocessing

    from uc_checkpoint.volumes.s3_client import CLIENTS

    volume = s3_volume(s3_server, s3_bucket, "forked")
    parents = id(volume.client)
    ctx = multiprocessing.get_context("fork")
    answers = ctx.SimpleQueue()
    with CLIENTS._lock:  # as while another thread builds a client
        child = ctx.Process(target=_child_lists, args=(volume, answers))
        child.start()
    child.join(60)
    assert child.exitcode == 0, "the forked child hung or failed"
    listed, childs = answers.get()
    assert listed == {} and childs != parents
    # A volume the child builds itself, while the parent's lock is held again at the fork.
    with CLIENTS._lock:
        child = ctx.Process(
            target=_child_lists, args=(None, answers), kwargs={"where": (s3_server, s3_bucket, "forked/new")}
        )
        child.start()
    child.join(60)
    assert child.exitcode == 0, "the forked child hung or failed"
    assert answers.get()[0] == {}


def _child_lists(volume: S3Volume | None, answers: Any, where: tuple[str, str, str] | None = None) -> None:
    if volume is None:
        assert where is not None
        volume = s3_volume(*where)
    answers.put((volume.list_files(), id(volume.client)))


@pytest.mark.parametrize("which", ["credentials", "config"])
def test_credentials_rotated_in_a_shared_file_give_a_new_client(
    s3_server: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    import os

    shared = tmp_path / which
    shared.write_text("[default]\naws_access_key_id = OLDKEY\naws_secret_access_key = s\n")
    if which == "credentials":
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    else:
        monkeypatch.setenv("AWS_CONFIG_FILE", str(shared))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)

    def key_of(volume: S3Volume) -> str:
        return volume.client._request_signer._credentials.get_frozen_credentials().access_key

    first = s3_volume(s3_server, s3_bucket, f"rotate-{which}/1")
    assert key_of(first) == "OLDKEY" and key_of(s3_volume(s3_server, s3_bucket, f"rotate-{which}/2")) == "OLDKEY"
    shared.write_text("[default]\naws_access_key_id = NEWKEY\naws_secret_access_key = s\n")
    os.utime(shared, ns=(shared.stat().st_atime_ns, shared.stat().st_mtime_ns + 1_000_000_000))
    assert key_of(s3_volume(s3_server, s3_bucket, f"rotate-{which}/3")) == "NEWKEY"


def test_small_targets_inside_a_large_ones_memory_and_adjacent_views(
    s3_server: str, s3_bucket: str, staging: Path
) -> None:
    """More of the kind the tester found: a small plan tensor (decoded from the buffer) lying inside a
    large one's memory keeps both out of in-place reads; views of one buffer that do not overlap are
    each received in place."""
    x, small, y = torch.randn(512, 512), torch.randn(16, 512), torch.randn(512, 512)
    volume = _ViewRecordingVolume(f"s3://{s3_bucket}/inside", endpoint_url=s3_server)
    volume.addresses = []
    dcp.save({"x": x, "small": small, "y": y}, storage_writer=UCVolumeWriter(volume))
    big = torch.zeros(512, 512)
    dcp.load({"x": big, "small": big[100:116]}, storage_reader=UCVolumeReader(volume))
    assert torch.equal(big[:100], x[:100]) and torch.equal(big[116:], x[116:])
    assert torch.equal(big[100:116], small) or torch.equal(big[100:116], x[100:116])
    assert all(addr != big.data_ptr() for addr, _ in volume.addresses)  # not received in place
    volume.addresses.clear()
    buf = torch.zeros(1024, 512)
    dcp.load({"x": buf[:512], "y": buf[512:]}, storage_reader=UCVolumeReader(volume))
    assert torch.equal(buf[:512], x) and torch.equal(buf[512:], y)
    for half in (buf[:512], buf[512:]):
        assert (half.data_ptr(), half.numel() * 4) in volume.addresses
