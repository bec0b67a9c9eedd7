"""The fault-injecting proxy in tests/support/s3_fixtures.py, checked with real boto3 and moto.

Every request goes boto3 -> FaultProxy -> moto server; what the server stored is read back
with a client that bypasses the proxy, so a proxy that mangled bytes cannot hide it.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ResponseStreamingError,
)

from tests.support.s3_fixtures import (
    FaultProxy,
    _empty_and_delete_bucket,
    key_prefix,
    s3_client,
    use_trailing_checksums,
)

MiB = 1024 * 1024
# Small parts keep the multipart cases quick; 5 MiB is S3's minimum part size.
MULTIPART = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stored(s3_server: str, bucket: str, key: str) -> bytes:
    """The object's bytes as the server holds them, read without the proxy."""
    return s3_client(s3_server).get_object(Bucket=bucket, Key=key)["Body"].read()


def test_round_trip_without_faults(fault_proxy: FaultProxy, s3_server: str, s3_bucket: str, tmp_path: Path) -> None:
    client = s3_client(fault_proxy.url)
    small = os.urandom(1000)
    client.put_object(Bucket=s3_bucket, Key="small", Body=small)
    client.put_object(Bucket=s3_bucket, Key="empty", Body=b"")
    assert client.get_object(Bucket=s3_bucket, Key="small")["Body"].read() == small
    assert client.get_object(Bucket=s3_bucket, Key="empty")["Body"].read() == b""
    assert client.head_object(Bucket=s3_bucket, Key="small")["ContentLength"] == 1000

    # 12 MiB in 5 MiB parts: three concurrent UploadParts, then ranged GETs on download.
    big = os.urandom(12 * MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(big)
    client.upload_file(str(src), s3_bucket, "big", Config=MULTIPART)
    assert _sha(_stored(s3_server, s3_bucket, "big")) == _sha(big)
    assert client.head_object(Bucket=s3_bucket, Key="big")["ETag"].endswith('-3"')
    dst = tmp_path / "back.bin"
    client.download_file(s3_bucket, "big", str(dst), Config=MULTIPART)
    assert _sha(dst.read_bytes()) == _sha(big)

    assert fault_proxy.injected == {}
    # botocore asks for "100 Continue" before every file-like upload body.
    assert any(r.header("Expect") == "100-continue" for r in fault_proxy.history)
    parts = [r for r in fault_proxy.history if r.method == "PUT" and "partNumber=" in r.path]
    assert len(parts) == 3
    assert all(r.status is not None and 200 <= r.status < 300 for r in fault_proxy.history)
    assert fault_proxy.requests == len(fault_proxy.history)


def test_client_connections_are_kept_alive(fault_proxy: FaultProxy, s3_bucket: str) -> None:
    client = s3_client(fault_proxy.url)
    for i in range(10):
        client.put_object(Bucket=s3_bucket, Key=f"k{i}", Body=b"x" * i)
        client.get_object(Bucket=s3_bucket, Key=f"k{i}")["Body"].read()
    assert fault_proxy.requests == 20
    # Sequential calls reuse one pooled connection; allow a spare for pool timing.
    assert fault_proxy.connections <= 2


def test_aws_chunked_bodies_are_forwarded(fault_proxy: FaultProxy, s3_server: str, s3_bucket: str) -> None:
    client = s3_client(fault_proxy.url)
    use_trailing_checksums(client)
    body = os.urandom(300_000)
    client.put_object(Bucket=s3_bucket, Key="one", Body=body)
    # A single part may be smaller than 5 MiB, which keeps this quick.
    part = os.urandom(200_000)
    upload_id = client.create_multipart_upload(Bucket=s3_bucket, Key="multi")["UploadId"]
    etag = client.upload_part(Bucket=s3_bucket, Key="multi", UploadId=upload_id, PartNumber=1, Body=io.BytesIO(part))[
        "ETag"
    ]
    client.complete_multipart_upload(
        Bucket=s3_bucket, Key="multi", UploadId=upload_id, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]}
    )

    uploads = [r for r in fault_proxy.history if r.method == "PUT" and r.framing != "none"]
    assert len(uploads) == 2  # PutObject + UploadPart
    for record in uploads:
        assert record.framing == "chunked"
        assert record.header("Content-Encoding") == "aws-chunked"
        assert record.header("X-Amz-Trailer") == "x-amz-checksum-crc32"
    assert _stored(s3_server, s3_bucket, "one") == body
    assert _stored(s3_server, s3_bucket, "multi") == part


def test_throttles_and_errors_are_retried(
    fault_proxy: FaultProxy, s3_server: str, s3_bucket: str, fast_retries: float
) -> None:
    fault_proxy.throttle_rate = 0.3
    fault_proxy.error_rate = 0.1
    client = s3_client(fault_proxy.url, retries={"mode": "standard", "max_attempts": 10})
    bodies = {f"obj{i:02d}": os.urandom(100 + i) for i in range(20)}
    for key, body in bodies.items():
        client.put_object(Bucket=s3_bucket, Key=key, Body=body)

    assert fault_proxy.injected["throttle"] > 0
    assert fault_proxy.injected["error"] > 0
    assert set(fault_proxy.injected) <= {"throttle", "error"}
    assert fault_proxy.requests == len(bodies) + sum(fault_proxy.injected.values())
    statuses = {r.status for r in fault_proxy.history}
    assert statuses == {200, 503, 500}
    for key, body in bodies.items():
        assert _stored(s3_server, s3_bucket, key) == body


@pytest.mark.parametrize(
    ("retries", "attempts"),
    [
        ({"mode": "standard", "total_max_attempts": 2}, 2),
        # botocore's max_attempts counts retries, not attempts.
        ({"mode": "standard", "max_attempts": 2}, 3),
    ],
)
def test_fail_all_exhausts_attempts(
    fault_proxy: FaultProxy, s3_server: str, s3_bucket: str, fast_retries: float, retries: dict, attempts: int
) -> None:
    fault_proxy.fail_all = True
    client = s3_client(fault_proxy.url, retries=retries)
    with pytest.raises(ClientError) as info:
        client.put_object(Bucket=s3_bucket, Key="k", Body=b"data")
    assert info.value.response["Error"]["Code"] == "SlowDown"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert fault_proxy.requests == attempts
    assert fault_proxy.injected == {"throttle": attempts}

    # HEAD errors carry no body, so botocore can only report the status code.
    with pytest.raises(ClientError) as info:
        client.head_object(Bucket=s3_bucket, Key="k")
    assert info.value.response["Error"]["Code"] == "503"

    fault_proxy.fail_all = False
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"data")
    assert _stored(s3_server, s3_bucket, "k") == b"data"


def test_key_prefix_names_the_partition_a_request_is_charged_to() -> None:
    assert key_prefix("/b/ckpt/step_1/__0_t_0.distcp") == "b/ckpt/step_1"
    assert key_prefix("/b/ckpt/step_1/3a/__0_t_0.distcp?partNumber=2&uploadId=x") == "b/ckpt/step_1/3a"
    assert key_prefix("/b/multi%20rank/0/f.distcp") == "b/multi rank/0"  # keys are percent-encoded
    assert key_prefix("/b?list-type=2&prefix=ckpt%2Fstep_1%2F&delimiter=%2F") == "b/ckpt/step_1"
    assert key_prefix("/b/top") == "b/"
    assert key_prefix("/b/ckpt/step_1/3a/f", 2) == "b/ckpt/step_1"
    assert key_prefix("/b/ckpt/step_1/3a/f", lambda key: key[:4]) == "b/ckpt"


def test_prefix_rate_limit_throttles_each_prefix_on_its_own(fault_proxy: FaultProxy, s3_bucket: str) -> None:
    # 5 requests per 30 s window: the window never slides during the test, so the counts are exact.
    fault_proxy.prefix_rate_limit = (None, 5 / 30)
    fault_proxy.prefix_window_s = 30.0
    client = s3_client(fault_proxy.url, retries={"mode": "standard", "total_max_attempts": 1})
    codes = []
    for i in range(8):
        try:
            client.put_object(Bucket=s3_bucket, Key=f"hot/k{i}", Body=b"x")
            codes.append(200)
        except ClientError as exc:
            assert exc.response["Error"]["Code"] == "SlowDown"
            codes.append(exc.response["ResponseMetadata"]["HTTPStatusCode"])
    assert codes == [200] * 5 + [503] * 3
    # Another prefix has its own budget; a listing of the hot one is charged to it.
    for i in range(5):
        client.put_object(Bucket=s3_bucket, Key=f"cool/k{i}", Body=b"x")
    with pytest.raises(ClientError) as info:
        client.list_objects_v2(Bucket=s3_bucket, Prefix="hot/", Delimiter="/")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    hot, cool = f"{s3_bucket}/hot", f"{s3_bucket}/cool"
    assert fault_proxy.prefix_throttled == {hot: 4}
    assert fault_proxy.prefix_requests == {hot: 9, cool: 5}
    assert fault_proxy.injected == {"throttle": 4}


def test_prefix_rate_limit_window_slides(fault_proxy: FaultProxy, s3_bucket: str) -> None:
    fault_proxy.prefix_rate_limit = (None, 2.0)  # 2 requests per 1 s window
    client = s3_client(fault_proxy.url, retries={"mode": "standard", "total_max_attempts": 1})
    client.put_object(Bucket=s3_bucket, Key="p/a", Body=b"x")
    client.put_object(Bucket=s3_bucket, Key="p/b", Body=b"x")
    with pytest.raises(ClientError):
        client.put_object(Bucket=s3_bucket, Key="p/c", Body=b"x")
    time.sleep(1.05)  # the window has moved past both requests
    client.put_object(Bucket=s3_bucket, Key="p/c", Body=b"x")
    assert fault_proxy.prefix_throttled == {f"{s3_bucket}/p": 1}


def test_error_is_internal_error(fault_proxy: FaultProxy, s3_bucket: str) -> None:
    fault_proxy.error_rate = 1.0
    client = s3_client(fault_proxy.url, retries={"mode": "standard", "total_max_attempts": 1})
    with pytest.raises(ClientError) as info:
        client.get_object(Bucket=s3_bucket, Key="missing")
    assert info.value.response["Error"]["Code"] == "InternalError"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert fault_proxy.injected == {"error": 1}


def test_cut_get_truncates_body(fault_proxy: FaultProxy, s3_server: str, s3_bucket: str) -> None:
    body = os.urandom(MiB)
    s3_client(s3_server).put_object(Bucket=s3_bucket, Key="k", Body=body)
    fault_proxy.cut_rate = 1.0
    client = s3_client(fault_proxy.url)
    # Status and headers arrive intact, so the call itself succeeds; the body read fails.
    response = client.get_object(Bucket=s3_bucket, Key="k")
    assert response["ContentLength"] == MiB
    with pytest.raises(ResponseStreamingError, match="IncompleteRead"):
        response["Body"].read()
    assert fault_proxy.injected == {"cut": 1}


def test_cut_put_never_reaches_server(fault_proxy: FaultProxy, s3_server: str, s3_bucket: str) -> None:
    fault_proxy.cut_rate = 1.0
    client = s3_client(fault_proxy.url, retries={"mode": "standard", "total_max_attempts": 1})
    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket=s3_bucket, Key="k", Body=os.urandom(200_000))
    # A HEAD has no body to truncate: the connection closes with no response at all.
    with pytest.raises(ConnectionClosedError):
        client.head_object(Bucket=s3_bucket, Key="k")
    assert fault_proxy.injected == {"cut": 2}
    assert [r.status for r in fault_proxy.history] == [None, None]
    with pytest.raises(ClientError) as info:
        s3_client(s3_server).head_object(Bucket=s3_bucket, Key="k")
    assert info.value.response["Error"]["Code"] == "404"


def test_match_limits_faults(fault_proxy: FaultProxy, s3_server: str, s3_bucket: str, fast_retries: float) -> None:
    fault_proxy.fail_all = True
    fault_proxy.match = lambda method, path: method == "PUT" and path.endswith("/bad")
    client = s3_client(fault_proxy.url, retries={"mode": "standard", "total_max_attempts": 3})
    client.put_object(Bucket=s3_bucket, Key="good", Body=b"g")
    assert client.get_object(Bucket=s3_bucket, Key="good")["Body"].read() == b"g"
    with pytest.raises(ClientError):
        client.put_object(Bucket=s3_bucket, Key="bad", Body=b"b")
    assert fault_proxy.injected == {"throttle": 3}
    assert [(r.method, r.path.rsplit("/", 1)[-1], r.fault) for r in fault_proxy.history] == [
        ("PUT", "good", None),
        ("GET", "good", None),
        ("PUT", "bad", "throttle"),
        ("PUT", "bad", "throttle"),
        ("PUT", "bad", "throttle"),
    ]

    # Only the second part of a multipart upload is cut, once; the transfer retries it.
    fault_proxy.fail_all = False
    fault_proxy.cut_rate = 1.0
    fault_proxy.match = lambda method, path: "partNumber=2&" in path + "&" and fault_proxy.injected["cut"] == 0
    data = os.urandom(5 * MiB + 100_000)  # part 2 is the small tail
    client.upload_fileobj(io.BytesIO(data), s3_bucket, "multi", Config=MULTIPART)
    assert fault_proxy.injected["cut"] == 1
    assert _sha(_stored(s3_server, s3_bucket, "multi")) == _sha(data)


def test_stop_refuses_new_connections(s3_server: str) -> None:
    with FaultProxy(s3_server) as proxy:
        url = proxy.url
        client = s3_client(url, retries={"mode": "standard", "total_max_attempts": 1})
        client.list_buckets()
    assert proxy.requests == 1
    with pytest.raises(EndpointConnectionError):
        client.list_buckets()


class _OddFramingUpstream(BaseHTTPRequestHandler):
    """Answers GET /chunked with a chunked body, GET /close with a close-delimited one, and
    any PUT with the SHA-256 of the de-chunked request body plus its raw chunk lines."""

    protocol_version = "HTTP/1.1"
    PIECES = [b"alpha-", b"beta-" * 1000, b"gamma"]

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in self.PIECES:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"".join(self.PIECES))
            self.close_connection = True

    def do_PUT(self) -> None:
        body, sizes = b"", []
        while True:
            line = self.rfile.readline()
            sizes.append(line.strip().decode())
            size = int(line.split(b";")[0], 16)
            if size == 0:
                break
            body += self.rfile.read(size)
            self.rfile.readline()
        trailer = self.rfile.readline().strip().decode()  # one trailer line, then CRLF
        self.rfile.readline()
        reply = f"{_sha(body)} {','.join(sizes)} {trailer}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def test_reframes_responses_and_relays_chunked_requests() -> None:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _OddFramingUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    expected = b"".join(_OddFramingUpstream.PIECES)
    try:
        with FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as proxy:
            conn = http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]))
            for path in ("/chunked", "/close", "/chunked"):
                conn.request("GET", path)
                response = conn.getresponse()
                assert response.read() == expected
                assert not response.will_close  # re-chunked, so keep-alive survives

            # A chunked request body goes through with its chunk sizes and trailer intact.
            conn.putrequest("PUT", "/upload")
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for piece in _OddFramingUpstream.PIECES:
                conn.send(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
            conn.send(b"0\r\nx-amz-checksum-crc32:AAAAAA==\r\n\r\n")
            reply = conn.getresponse().read().decode()
            conn.close()
        sizes = "6;ext=1,1388;ext=1,5;ext=1,0"
        assert reply == f"{_sha(expected)} {sizes} x-amz-checksum-crc32:AAAAAA=="
        assert proxy.connections == 1
        assert [r.framing for r in proxy.history] == ["none"] * 3 + ["chunked"]
    finally:
        upstream.shutdown()
        upstream.server_close()


def test_bucket_cleanup_removes_versions_and_uploads(s3_server: str) -> None:
    client = s3_client(s3_server)
    name = "uc-test-cleanup-versions"
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    client.put_object(Bucket=name, Key="k", Body=b"1")
    client.put_object(Bucket=name, Key="k", Body=b"2")
    client.delete_object(Bucket=name, Key="k")  # leaves a delete marker
    client.create_multipart_upload(Bucket=name, Key="pending")
    _empty_and_delete_bucket(client, name)
    assert name not in {b["Name"] for b in client.list_buckets()["Buckets"]}
