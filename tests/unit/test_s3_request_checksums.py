"""Which CRC-32 an upload's request carries, and whether botocore then signs the body, on plain
HTTP and over TLS. There is no TLS S3 server here, so the requests are taken after botocore signed
them (its ``before-send`` event) and answered there, never sent; the plain-HTTP behaviour against a
real server is in tests/functional/test_s3_volume.py."""

from __future__ import annotations

import base64
import zlib
from pathlib import Path
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse

from uc_checkpoint.volumes.s3 import S3Volume

FAKE = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class _Body:
    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def stream(self, **_: Any):
        yield self.data


def _answering(volume: S3Volume, crc_b64: str) -> list[dict[str, str]]:
    """Answer every request of ``volume``'s client with a 200 echoing ``crc_b64``; returns the
    headers of each request as signed."""
    seen: list[dict[str, str]] = []

    def answer(request: Any, **_: Any) -> AWSResponse:
        seen.append({k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})
        return AWSResponse(request.url, 200, {"ETag": '"x"', "x-amz-checksum-crc32": crc_b64}, _Body())

    volume.client.meta.events.register("before-send.s3", answer)
    return seen


@pytest.mark.parametrize(
    ("endpoint", "sign_payload", "own_crc", "body_hash"),
    [
        ("http://127.0.0.1:9", None, True, "sha256"),  # botocore signs bodies on plain HTTP anyway
        ("https://s3.example.invalid", None, False, "STREAMING-UNSIGNED-PAYLOAD-TRAILER"),
        ("https://s3.example.invalid", False, True, "UNSIGNED-PAYLOAD"),
        ("http://127.0.0.1:9", False, True, "UNSIGNED-PAYLOAD"),
        ("https://s3.example.invalid", True, True, "sha256"),
    ],
)
def test_a_put_never_makes_botocore_hash_a_body_it_would_not_have_hashed(
    endpoint: str,
    sign_payload: bool | None,
    own_crc: bool,
    body_hash: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in FAKE.items():
        monkeypatch.setenv(k, v)
    payload = b"staged bytes " * 1000
    staged = tmp_path / "f.distcp"
    staged.write_bytes(payload)
    crc = base64.b64encode(zlib.crc32(payload).to_bytes(4, "big")).decode()
    volume = S3Volume("s3://bucket/p", endpoint_url=endpoint, sign_payload=sign_payload, max_attempts=1)
    seen = _answering(volume, crc)
    record = volume.upload_file(staged, "f.distcp")
    assert record.size == len(payload)
    (put,) = seen  # the answer echoing the staged file's CRC-32 proves the upload: no HEAD
    assert ("x-amz-checksum-crc32" in put) == own_crc, put
    if own_crc:
        assert put["x-amz-checksum-crc32"] == crc
    else:  # botocore's own CRC-32 of the bytes it streams, in a trailer
        assert put.get("x-amz-trailer") == "x-amz-checksum-crc32", put
    sent_hash = put["x-amz-content-sha256"]
    if body_hash == "sha256":
        assert len(sent_hash) == 64 and all(c in "0123456789abcdef" for c in sent_hash), sent_hash
    else:
        assert sent_hash == body_hash


def test_a_store_answering_another_crc_fails_the_upload_over_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from uc_checkpoint.errors import TransferError

    for k, v in FAKE.items():
        monkeypatch.setenv(k, v)
    staged = tmp_path / "f.distcp"
    staged.write_bytes(b"abc" * 100)
    volume = S3Volume("s3://bucket/p", endpoint_url="https://s3.example.invalid", max_attempts=1)
    _answering(volume, base64.b64encode(b"\0\0\0\1").decode())
    with pytest.raises(TransferError, match=r"s3://bucket/p/f\.distcp was stored with CRC-32"):
        volume.upload_file(staged, "f.distcp")


def test_a_client_shared_by_many_volumes_gets_our_handlers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    for k, v in FAKE.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url="http://127.0.0.1:9")
    registered: list[str] = []
    register = client.meta.events.register

    def counted(event: str, handler: Any, *a: Any, **kw: Any) -> Any:
        registered.append(event)
        return register(event, handler, *a, **kw)

    monkeypatch.setattr(client.meta.events, "register", counted)
    volumes = [S3Volume(f"s3://bucket/p{i}", client=client) for i in range(3)]
    volumes += [S3Volume(f"s3://bucket/q{i}", client_factory=lambda: client) for i in range(2)]
    for v in volumes:
        v.client  # noqa: B018 - takes the client
    assert sorted(registered) == sorted(
        ["after-call.s3", "before-call.s3.GetObject", "before-parameter-build.s3.UploadPart"]
    )
    hooks = {id(v._shared.part_checksums) for v in volumes}
    assert len(hooks) == 1  # one registry: two uploads of one key through it are told apart


def _answering_multipart(volume: S3Volume, size: int) -> list[tuple[str, dict[str, str]]]:
    """Answer a multipart upload of ``size`` bytes (create, parts, complete, then the HEAD that
    verifies it); returns (method and target, signed headers) of each request."""
    seen: list[tuple[str, dict[str, str]]] = []

    def answer(request: Any, **_: Any) -> AWSResponse:
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        seen.append((f"{request.method} {request.url}", headers))
        if request.method == "POST" and "uploads" in request.url.split("?")[1]:
            xml = b"<InitiateMultipartUploadResult><Bucket>bucket</Bucket><Key>p/f.distcp</Key><UploadId>u1</UploadId></InitiateMultipartUploadResult>"
            return AWSResponse(request.url, 200, {}, _Body(xml))
        if request.method == "POST":
            xml = b'<CompleteMultipartUploadResult><ETag>"x-3"</ETag></CompleteMultipartUploadResult>'
            return AWSResponse(request.url, 200, {}, _Body(xml))
        if request.method == "HEAD":
            return AWSResponse(request.url, 200, {"Content-Length": str(size), "ETag": '"x-3"'}, _Body())
        return AWSResponse(request.url, 200, {"ETag": '"p"'}, _Body())

    volume.client.meta.events.register("before-send.s3", answer)
    return seen


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "https://s3.example.invalid"])
def test_parts_carry_our_crcs_only_where_botocore_signs_bodies_anyway(
    endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in FAKE.items():
        monkeypatch.setenv(k, v)
    part = 5 << 20
    payload = bytes(range(256)) * ((2 * part + 1000) // 256)
    staged = tmp_path / "f.distcp"
    staged.write_bytes(payload)
    volume = S3Volume("s3://bucket/p", endpoint_url=endpoint, multipart_threshold=part, part_size=part, max_attempts=1)
    seen = _answering_multipart(volume, len(payload))
    volume.upload_file(staged, "f.distcp")
    parts = [h for what, h in seen if what.startswith("PUT") and "partNumber=" in what]
    assert len(parts) == 3
    for n, headers in enumerate(sorted(parts, key=lambda h: h.get("content-length", ""), reverse=True)):
        if endpoint.startswith("https"):  # botocore's trailer, body unsigned: as without us
            assert "x-amz-checksum-crc32" not in headers and headers.get("x-amz-trailer") == "x-amz-checksum-crc32"
            assert headers["x-amz-content-sha256"] == "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
        else:  # the body is signed anyway; the CRC-32 is the staged file's part's
            assert len(headers["x-amz-content-sha256"]) == 64
            assert headers["x-amz-checksum-crc32"] in {
                base64.b64encode(zlib.crc32(payload[i * part : (i + 1) * part]).to_bytes(4, "big")).decode()
                for i in range(3)
            }, n
