"""Pytest plugin: a local S3 endpoint (moto's server) and an HTTP proxy that injects faults.

Register it with ``pytest_plugins = ["tests.support.s3_fixtures"]``. It provides:

* ``s3_server`` (session): a ``moto.server.ThreadedMotoServer`` on 127.0.0.1, yields its URL.
* ``s3_bucket`` (function): a fresh, uniquely named bucket on that server, emptied and
  deleted afterwards.
* ``fault_proxy`` (function): a started :class:`FaultProxy` in front of ``s3_server``.
* ``fast_retries`` (function): botocore's retry backoff shrunk 100-fold.
* :func:`s3_client`: a boto3 S3 client for an endpoint URL (path-style, us-east-1).
* :func:`use_trailing_checksums`: make a client upload the way it does over https.

The proxy sits between boto3 and moto at the HTTP level, so tests can see how code behaves
when S3 throttles, fails, or drops connections, without patching the code under test or
botocore. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import logging
import os
import random
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import boto3
import pytest
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import ClientError

log = logging.getLogger(__name__)

#: Fault kinds, as used for :attr:`FaultProxy.injected` keys and :attr:`ProxyRecord.fault`.
THROTTLE = "throttle"  # 503 SlowDown
ERROR = "error"  # 500 InternalError
CUT = "cut"  # connection closed mid-request or mid-response
LOST = "lost"  # relayed whole to the store, which acts on it; the client's connection then closes unanswered
STALL = "stall"  # nothing sent back for ``stall_s`` seconds, then relayed (a slow or hung store)
REJECTED_HEADER = "rejected-header"  # 400 InvalidArgument: "Unsupported header" (S3-compatible stores)
REJECTED_CONDITION = "rejected-condition"  # 501 NotImplemented for If-None-Match

REGION = "us-east-1"

#: How ``FaultProxy(prefix_rate_limit=(how, rate))`` names a request's key prefix: None for the
#: key's parent ("a/b" for the key "a/b/c"), an int for the key's first that many "/"-separated
#: segments, or a function of the key.
PrefixOf = int | Callable[[str], str] | None


def key_prefix(target: str, how: PrefixOf = None) -> str:
    """``"<bucket>/<prefix>"`` of a request target (``"/bucket/a/b/c?query"``, path-style), the
    prefix as ``how`` names it (see :data:`PrefixOf`). A bucket-level request (a listing, the
    multipart-upload listing) is taken at its ``prefix=`` query parameter, as S3 charges a LIST to
    the prefix it lists: ``?list-type=2&prefix=a/b/`` counts under ``a/b``."""
    parts = urlsplit(target)
    bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
    if not key:
        key = parse_qs(parts.query).get("prefix", [""])[0]
    if how is None:
        prefix = key.rpartition("/")[0]
    elif isinstance(how, int):
        prefix = "/".join(key.split("/")[:how])
    else:
        prefix = how(key)
    return f"{bucket}/{prefix}"


# Bytes moved per read/write while relaying bodies; large enough to keep the per-chunk
# Python overhead small, small enough that big objects are never held whole.
_COPY_BYTES = 256 * 1024
# Longest chunk-size or trailer line accepted in a chunked request body.
_MAX_LINE = 64 * 1024

# Headers that describe one hop, not the message. Upstream's must not reach the client:
# werkzeug answers every request with "Connection: close", which would otherwise end
# the client's keep-alive connection after each request; we frame the body ourselves.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)

# Fault kind -> (status, reason phrase, S3 error code, message), as S3 words them.
_ERROR_STATUS = {
    THROTTLE: (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    ERROR: (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    REJECTED_CONDITION: (
        501,
        "Not Implemented",
        "NotImplemented",
        "A header you provided implies functionality that is not implemented",
    ),
}


@dataclass
class ProxyRecord:
    """One request the proxy saw.

    ``path`` is the raw request target (path plus query string, as sent). ``framing`` is
    how the request body was delimited: ``"none"``, ``"length"`` (Content-Length) or
    ``"chunked"`` (Transfer-Encoding: chunked). ``headers`` are the request headers as
    received, in order. ``status`` is the status sent to the client, or ``None`` when the
    connection was cut before a status line went out (or the client went away).
    """

    method: str
    path: str
    fault: str | None
    framing: str
    headers: list[tuple[str, str]]
    status: int | None = None

    def header(self, name: str) -> str | None:
        """The first value of request header ``name`` (case-insensitive), or ``None``."""
        wanted = name.lower()
        return next((v for k, v in self.headers if k.lower() == wanted), None)


class _ProxyServer(ThreadingHTTPServer):
    """A threading HTTP server that knows its :class:`FaultProxy`."""

    daemon_threads = True
    # Connection bursts from boto3's pool (10 connections) plus transfer threads.
    request_queue_size = 64

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(BaseHTTPRequestHandler):
    """Relays one client connection (possibly many keep-alive requests) to the upstream."""

    protocol_version = "HTTP/1.1"  # keep-alive and chunked framing towards the client
    server: _ProxyServer
    # Socket timeout in seconds for reads and writes on the client connection; ends idle
    # keep-alive connections that a test forgot, without cutting slow transfers short.
    timeout = 120
    # Headers and body go out in separate writes; with Nagle on, a small body waits for
    # the client's delayed ACK (about 40 ms a response).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self._upstream_conn: http.client.HTTPConnection | None = None
        # The record of the request being relayed; None between requests.
        self._current: ProxyRecord | None = None
        # Whether this connection has carried a request (stop() opens empty ones).
        self._served = False
        self.server.proxy._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._close_upstream()
            self.server.proxy._track(self.connection, add=False)

    def send_response_only(self, code: int, message: str | None = None) -> None:
        # Noted before the headers go out: once the client has the response it may move
        # on, and a test reading the history must already see the status.
        if self._current is not None:
            self._current.status = code
        super().send_response_only(code, message)

    def handle_expect_100(self) -> bool:
        # Defer the interim response: _relay sends it once it has decided to read the body.
        return True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        log.debug("fault proxy: " + format, *args)

    # Every method goes through the same relay.
    def do_GET(self) -> None:
        self._relay()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    # -- request side -------------------------------------------------------------------

    def _relay(self) -> None:
        proxy = self.server.proxy
        method = self.command
        # parse_request() has checked that the request line has three words; the raw target
        # is forwarded as-is rather than the (possibly normalised) self.path.
        target = self.requestline.split()[1]
        try:
            framing, length = self._request_framing()
        except _BadRequestBody as exc:
            self.send_error(400, str(exc))
            self.close_connection = True
            return
        fault = proxy._decide(method, target)
        if proxy.latency_s > 0:
            proxy._stopping.wait(proxy.latency_s)  # the store's time to answer, refusals included
        rejected = proxy._rejected_header(self.headers)
        if rejected is not None:
            fault = REJECTED_HEADER
        elif proxy.conditional_writes == "reject" and self.headers.get("If-None-Match") is not None:
            fault = REJECTED_CONDITION
        if fault in (REJECTED_HEADER, REJECTED_CONDITION):
            with proxy._lock:
                proxy.injected[fault] += 1
        self._current = ProxyRecord(method, target, fault, framing, list(self.headers.items()))
        proxy._record(self._current, new_connection=not self._served)
        self._served = True
        try:
            if fault in (THROTTLE, ERROR, REJECTED_CONDITION):
                self._send_continue()
                self._copy_request_body(framing, length, sink=None)
                self._send_s3_error(fault, method)
            elif fault == REJECTED_HEADER:
                self._send_continue()
                self._copy_request_body(framing, length, sink=None)
                self._send_s3_error(
                    fault,
                    method,
                    (
                        400,
                        "Bad Request",
                        "InvalidArgument",
                        f"Unsupported header '{rejected}' received for this API call.",
                    ),
                )
            elif fault == STALL:
                # Hold the request (body unread) as a hung store would; the client's read
                # timeout usually fires first and it goes away, which ends the relay below.
                proxy._stopping.wait(proxy.stall_s)
                self._forward(method, target, framing, length, cut=False)
            elif fault == CUT and framing != "none":
                self._send_continue()
                self._copy_request_body(framing, length, sink=None, partial=True)
                self._cut()
            else:
                self._forward(method, target, framing, length, cut=fault == CUT, lose=fault == LOST)
        except (OSError, http.client.HTTPException, _BadRequestBody) as exc:
            # The client went away, sent a malformed body, or the upstream failed after
            # the response started: nothing sensible can follow on this connection.
            log.debug("fault proxy: %s %s aborted: %r", method, target, exc)
            self.close_connection = True
        finally:
            self._current = None

    def _request_framing(self) -> tuple[str, int]:
        """How the request body is delimited, and its length in bytes when known (else -1)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return "chunked", -1
        value = self.headers.get("Content-Length")
        if value is not None:
            try:
                return "length", int(value)
            except ValueError as exc:
                raise _BadRequestBody(f"bad Content-Length {value!r}") from exc
        return "none", 0

    def _send_continue(self) -> None:
        if self.headers.get("Expect", "").strip().lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _copy_request_body(
        self,
        framing: str,
        length: int,
        sink: Callable[[bytes], Any] | None,
        partial: bool = False,
    ) -> None:
        """Read the request body from the client, passing the raw bytes to ``sink``.

        Chunked bodies are passed on with their framing (size lines, trailers) intact, so
        an aws-chunked payload with a trailing checksum reaches the upstream unchanged.
        With ``partial`` only about half of the body is read (half of the first chunk for
        chunked bodies), which leaves the rest unread in the socket when we cut.
        """
        if framing == "length":
            self._copy_exact(length // 2 if partial else length, sink)
            return
        if framing != "chunked":
            return
        while True:
            line = self._read_line()
            if sink is not None:
                sink(line)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise _BadRequestBody(f"bad chunk size line {line[:80]!r}") from exc
            if partial:
                self._copy_exact(size // 2, sink)
                return
            if size == 0:
                break
            self._copy_exact(size + 2, sink)  # chunk data and its CRLF
        while True:  # trailer section, ended by an empty line
            line = self._read_line()
            if sink is not None:
                sink(line)
            if line in (b"\r\n", b"\n"):
                return

    def _read_line(self) -> bytes:
        line = self.rfile.readline(_MAX_LINE + 1)
        if not line.endswith(b"\n"):
            raise _BadRequestBody("truncated or overlong line in chunked body")
        return line

    def _copy_exact(self, nbytes: int, sink: Callable[[bytes], Any] | None) -> None:
        while nbytes > 0:
            data = self.rfile.read(min(nbytes, _COPY_BYTES))
            if not data:
                raise _BadRequestBody("client closed the connection mid-body")
            if sink is not None:
                sink(data)
            nbytes -= len(data)

    # -- response side ------------------------------------------------------------------

    def _send_s3_error(self, kind: str, method: str, detail: tuple[int, str, str, str] | None = None) -> None:
        """Answer with S3's XML error for ``kind`` (or ``detail``: status, reason, code, message);
        the connection stays usable."""
        status, reason, code, message = detail or _ERROR_STATUS[kind]
        request_id = uuid.uuid4().hex[:16].upper()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>{request_id}</RequestId><HostId>fault-proxy</HostId></Error>"
        ).encode()
        self.send_response_only(status, reason)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if method == "HEAD" else str(len(body)))
        self.send_header("x-amz-request-id", request_id)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def _forward(self, method: str, target: str, framing: str, length: int, cut: bool, lose: bool = False) -> None:
        """Send the request upstream and relay the response.

        With ``cut`` the upstream still executes the request, but the client gets only the
        status line, headers and about half of the body before the connection closes; a
        response without a body is not sent at all. With ``lose`` the upstream executes it and
        the client gets nothing: its connection closes once the upstream's response is read.
        """
        conn = self._upstream()
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            # Client headers go unchanged and in order: SigV4 signs Host and x-amz-*.
            ignore_condition = self.server.proxy.conditional_writes == "ignore"
            for name, value in self.headers.items():
                if ignore_condition and name.lower() == "if-none-match":
                    continue  # a store that does not know the header: the write goes through
                conn.putheader(name, value)
            conn.endheaders()
            if framing != "none":
                self._send_continue()
                self._copy_request_body(framing, length, sink=conn.send)
            resp = conn.getresponse()
        except _BadRequestBody:
            self._close_upstream()
            raise
        except (OSError, http.client.HTTPException) as exc:
            self._close_upstream()
            log.warning("fault proxy: upstream failed for %s %s: %r", method, target, exc)
            self._send_bad_gateway()
            return
        if lose:
            resp.read()
            self._close_upstream()
            if self._current is not None:
                self._current.status = None
            self._cut()
            return
        try:
            self._relay_response(method, resp, cut)
        finally:
            if cut or not resp.isclosed() or resp.will_close:
                self._close_upstream()

    def _relay_response(self, method: str, resp: http.client.HTTPResponse, cut: bool) -> None:
        bodiless = method == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        length_header = resp.getheader("Content-Length")
        length = int(length_header) if length_header is not None and not resp.chunked else None
        if cut and (bodiless or (length is not None and length < 2)):
            self._cut()
            return
        # Upstream's framing is not ours to keep: a body of unknown length is re-chunked
        # for an HTTP/1.1 client (keeping its connection alive) and close-delimited
        # otherwise.
        chunk_out = not bodiless and length is None and self.request_version == "HTTP/1.1"
        self.send_response_only(resp.status, resp.reason)
        for name, value in resp.msg.items():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        if chunk_out:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if bodiless:
            resp.read()  # marks the upstream response complete; there is nothing to read
            return
        if length is None and not chunk_out:
            self.close_connection = True
        # A cut forwards half of a body of known length, else its first piece.
        budget = length // 2 if cut and length is not None else None
        sent = 0
        while budget is None or sent < budget:
            want = _COPY_BYTES if budget is None else min(_COPY_BYTES, budget - sent)
            data = resp.read1(want)
            if not data:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunk_out else data)
            sent += len(data)
            if cut and budget is None:
                break
        if cut:
            self._cut()
            return
        if length is not None and sent != length:
            # Upstream short-changed us; the client must not take the next bytes for a
            # new response.
            log.warning("fault proxy: upstream sent %d of %d body bytes", sent, length)
            self.close_connection = True
        elif chunk_out:
            self.wfile.write(b"0\r\n\r\n")

    def _send_bad_gateway(self) -> None:
        self.send_response_only(502, "Bad Gateway")
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()

    def _cut(self) -> None:
        # Closing with request bytes still unread makes the kernel send RST, as a
        # crashed or overloaded front end would.
        self.close_connection = True
        try:
            self.wfile.flush()
        except OSError:
            pass

    # -- upstream connection ------------------------------------------------------------

    def _upstream(self) -> http.client.HTTPConnection:
        conn = self._upstream_conn
        if conn is not None and conn.sock is not None:
            # An idle keep-alive socket that is readable has been closed by the peer (or
            # holds garbage); sending on it would fail only after we consumed the body.
            readable, _, _ = select.select([conn.sock], [], [], 0)
            if readable:
                self._close_upstream()
                conn = None
        if conn is None:
            proxy = self.server.proxy
            conn = http.client.HTTPConnection(proxy._up_host, proxy._up_port, timeout=self.timeout)
            self._upstream_conn = conn
        return conn

    def _close_upstream(self) -> None:
        if self._upstream_conn is not None:
            self._upstream_conn.close()
            self._upstream_conn = None


class _BadRequestBody(Exception):
    """The client's request body ended early or was not valid chunked encoding."""


class FaultProxy:
    """A threaded HTTP/1.1 proxy that forwards to ``upstream`` and injects S3-style faults.

    Use as ``with FaultProxy("http://127.0.0.1:5000") as proxy: ...`` and point boto3 at
    ``proxy.url``. Requests are relayed without rewriting: method, raw target, headers (Host
    included, as SigV4 signs it) and body bytes, whether delimited by Content-Length or
    ``Transfer-Encoding: chunked``. Responses keep their status, reason and end-to-end
    headers and are streamed back in pieces of at most 256 KiB; hop-by-hop headers
    (werkzeug's ``Connection: close``) are dropped, and a body of unknown length is sent
    chunked, so client connections stay alive.

    Tunables are plain attributes, read once per request, so tests may change them while
    the proxy runs:

    * ``throttle_rate``: fraction (0..1) of eligible requests answered ``503 SlowDown``.
    * ``error_rate``: fraction answered ``500 InternalError``.
    * ``cut_rate``: fraction whose connection is cut. A request with a body has about half
      of it read, then the socket closes with no response; it never reaches the upstream.
      A request without a body (GET, HEAD, DELETE) is executed upstream, then the client
      gets the status, headers and about half of the response body before the socket
      closes, or no response at all when there is no body (HEAD, 204, empty body).
    * ``stall_rate``: fraction held for ``stall_s`` seconds (default 30) before being relayed,
      as a slow or hung store would: a client with a shorter read timeout gives up first.
    * ``fail_all``: when true, every eligible request is answered ``503 SlowDown``
      (counted as ``"throttle"``), overriding the rates.
    * ``latency_s``: seconds every request is held before it is answered or relayed (a store's
      time to first byte; 0 by default). It caps what one client connection can send: a test can
      then bound each client's request rate without depending on how fast the machine is.
    * ``prefix_rate_limit``: ``None``, or ``(how, rate)``: S3's per-partition request limit. Each
      eligible request is charged to its key prefix (:func:`key_prefix` with ``how``); a request
      that finds ``rate * prefix_window_s`` requests of its prefix already let through in the last
      ``prefix_window_s`` seconds (default 1) is answered ``503 SlowDown`` (counted as
      ``"throttle"``, and per prefix in ``prefix_throttled``); it does not count against the
      window, so at most ``rate`` requests per second of one prefix reach the server. Checked
      before the random faults; ``prefix_requests`` counts every eligible request per prefix.
    * ``reject_headers``: header-name prefixes (lower case) that, like several S3-compatible
      stores (Backblaze B2, older MinIO and Ceph releases), the proxy refuses with ``400
      InvalidArgument "Unsupported header '<name>' received for this API call."`` (counted as
      ``"rejected-header"``), e.g. ``("x-amz-sdk-checksum-algorithm", "x-amz-checksum-")``.
    * ``conditional_writes``: ``"ok"`` (relay ``If-None-Match``), ``"ignore"`` (drop the header:
      the write goes through even over an existing object) or ``"reject"`` (``501
      NotImplemented``, counted as ``"rejected-condition"``).
    * ``match``: ``None`` (all requests eligible) or ``match(method, target) -> bool``,
      where ``target`` is the raw request target, path plus query, e.g.
      ``"/bucket/key?partNumber=2&uploadId=..."``.
    * ``choose``: ``None``, or ``choose(method, target) -> kind | None``: the fault for each eligible
      request, chosen by the test instead of drawn (one of the kinds above, :data:`LOST` included;
      None forwards it intact). It overrides the rates, not ``fail_all``. :data:`LOST` is only
      reachable this way: the request goes to the store whole and the store acts on it, then the
      client's connection closes without an answer (a response lost on the way back).

    The rates are cumulative: one draw in [0, 1) selects throttle, then error, then cut,
    so their sum should not exceed 1. Draws happen in request arrival order from a
    ``random.Random(seed)``, so a sequential client sees the same faults on every run;
    concurrent clients do not. ``match`` runs on handler threads, outside the proxy's
    lock. Throttled and failed requests still have their body read (after a
    ``100 Continue`` if the client asked for one), so the client connection stays usable.

    Counters: ``requests`` counts every request seen, ``connections`` the client
    connections that carried at least one request, ``injected`` counts faults by kind
    (``"throttle"``, ``"error"``, ``"cut"``, ``"stall"``; a :class:`collections.Counter`, so missing
    kinds read as 0) and ``history`` lists a :class:`ProxyRecord` per request (unbounded:
    meant for short tests). :meth:`reset` zeroes them all.
    """

    def __init__(
        self,
        upstream: str,
        *,
        throttle_rate: float = 0.0,
        error_rate: float = 0.0,
        cut_rate: float = 0.0,
        fail_all: bool = False,
        match: Callable[[str, str], bool] | None = None,
        seed: int = 0,
        stall_rate: float = 0.0,
        stall_s: float = 30.0,
        reject_headers: tuple[str, ...] = (),
        conditional_writes: str = "ok",
        prefix_rate_limit: tuple[PrefixOf, float] | None = None,
        prefix_window_s: float = 1.0,
        latency_s: float = 0.0,
        choose: Callable[[str, str], str | None] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {upstream!r}")
        self.upstream = upstream
        self._up_host: str = parts.hostname
        self._up_port: int = parts.port or 80
        self.throttle_rate = throttle_rate
        self.error_rate = error_rate
        self.cut_rate = cut_rate
        self.fail_all = fail_all
        self.stall_rate = stall_rate
        self.stall_s = stall_s
        self.reject_headers = reject_headers
        self.conditional_writes = conditional_writes
        if prefix_rate_limit is not None and prefix_rate_limit[1] <= 0:
            raise ValueError(f"prefix_rate_limit's rate must be > 0 requests/s, got {prefix_rate_limit[1]}")
        if prefix_window_s <= 0:
            raise ValueError(f"prefix_window_s must be > 0 seconds, got {prefix_window_s}")
        self.latency_s = latency_s
        self.prefix_rate_limit = prefix_rate_limit
        self.prefix_window_s = prefix_window_s
        self.prefix_requests: collections.Counter[str] = collections.Counter()
        self.prefix_throttled: collections.Counter[str] = collections.Counter()
        # Per prefix: monotonic times of the requests let through within the last window.
        self._prefix_window: dict[str, collections.deque[float]] = {}
        self._stopping = threading.Event()
        self.match = match
        self.choose = choose
        self.seed = seed
        self.requests = 0
        self.connections = 0
        self.injected: collections.Counter[str] = collections.Counter()
        self.history: list[ProxyRecord] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server: _ProxyServer | None = None
        self._thread: threading.Thread | None = None
        self._active: set[socket.socket] = set()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` of the running proxy."""
        if self._server is None:
            raise RuntimeError("FaultProxy is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        """Bind 127.0.0.1 on a free port and serve in a daemon thread; returns self."""
        if self._server is not None:
            raise RuntimeError("FaultProxy already started")
        self._stopping.clear()
        self._server = _ProxyServer(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="fault-proxy",
            daemon=True,
        )
        self._thread.start()
        log.debug("fault proxy on %s -> %s", self.url, self.upstream)
        return self

    def stop(self) -> None:
        """Stop accepting, close open client connections, and release the port."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # releases stalled requests
        address = server.server_address[:2]
        stopper = threading.Thread(target=server.shutdown, name="fault-proxy-stop", daemon=True)
        stopper.start()
        # serve_forever() looks for the shutdown flag only when select() returns, which an
        # idle server does once per poll interval; a throwaway connection wakes it now.
        while stopper.is_alive():
            try:
                socket.create_connection(address, timeout=1).close()
            except OSError:
                pass
            stopper.join(0.05)
        with self._lock:
            active = list(self._active)
        for sock in active:
            # Wakes handler threads blocked on an idle keep-alive read.
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def reset(self) -> None:
        """Zero the counters and clear the history (tunables are left as they are)."""
        with self._lock:
            self.requests = 0
            self.connections = 0
            self.injected.clear()
            self.history.clear()
            self.prefix_requests.clear()
            self.prefix_throttled.clear()
            self._prefix_window.clear()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # Called from handler threads.

    def _rejected_header(self, headers: Any) -> str | None:
        """The first request header whose name starts with one of ``reject_headers``, or None."""
        prefixes = self.reject_headers
        for name in headers.keys() if prefixes else ():
            if name.lower().startswith(prefixes):
                return name.lower()
        return None

    def _decide(self, method: str, target: str) -> str | None:
        """Count the request and pick its fault kind, or ``None`` to forward it intact."""
        with self._lock:
            self.requests += 1
        match = self.match
        # Called without the lock so that a predicate may look at the proxy's counters.
        if match is not None and not match(method, target):
            return None
        limit = self.prefix_rate_limit
        prefix = None if limit is None else key_prefix(target, limit[0])
        choose = self.choose
        chosen = None if choose is None or self.fail_all else choose(method, target)
        with self._lock:
            if self.fail_all:
                kind: str | None = THROTTLE
            elif choose is not None:
                kind = chosen
            elif prefix is not None and limit is not None and self._over_rate(prefix, limit[1]):
                kind = THROTTLE
            else:
                draw = self._rng.random()
                kind = None
                edge = 0.0
                for name, rate in (
                    (THROTTLE, self.throttle_rate),
                    (ERROR, self.error_rate),
                    (CUT, self.cut_rate),
                    (STALL, self.stall_rate),
                ):
                    edge += rate
                    if draw < edge:
                        kind = name
                        break
            if kind is not None:
                self.injected[kind] += 1
            return kind

    def _over_rate(self, prefix: str, rate: float) -> bool:
        """Charge one request to ``prefix``; whether it exceeds ``rate`` (call under the lock)."""
        now = time.monotonic()
        window = self._prefix_window.setdefault(prefix, collections.deque())
        while window and window[0] <= now - self.prefix_window_s:
            window.popleft()
        self.prefix_requests[prefix] += 1
        if len(window) >= rate * self.prefix_window_s:
            self.prefix_throttled[prefix] += 1
            return True
        window.append(now)
        return False

    def _record(self, record: ProxyRecord, new_connection: bool) -> None:
        with self._lock:
            self.history.append(record)
            if new_connection:
                self.connections += 1

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._active.add(sock)
            else:
                self._active.discard(sock)


def s3_client(endpoint_url: str, **config: Any) -> BaseClient:
    """A boto3 S3 client for ``endpoint_url`` with path-style addressing in us-east-1.

    ``config`` goes to :class:`botocore.config.Config` (e.g. ``retries=...``,
    ``read_timeout=...`` in seconds); an ``s3`` dict is merged over path-style addressing.
    Credentials are the fake ``testing`` pair, so the client never looks for real ones.
    """
    s3_options = {"addressing_style": "path", **config.pop("s3", {})}
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(s3=s3_options, **config),
    )


def use_trailing_checksums(client: BaseClient) -> None:
    """Make ``client`` send PutObject/UploadPart bodies as aws-chunked with a trailer.

    Against real S3 (https) botocore sends streaming uploads as ``Transfer-Encoding:
    chunked`` + ``Content-Encoding: aws-chunked`` with the CRC32 in a trailer; over plain
    http it sends Content-Length and the checksum in a header instead. This switches the
    http case to the https wire format, so tests against the local server see the body
    framing that production traffic uses. It edits botocore's per-request checksum
    context (not public API) from a ``before-call`` hook, before the checksum is applied.
    """

    def _to_trailer(params: dict[str, Any], **_: Any) -> None:
        algorithm = params.get("context", {}).get("checksum", {}).get("request_algorithm")
        if isinstance(algorithm, dict):
            algorithm["in"] = "trailer"

    for operation in ("PutObject", "UploadPart"):
        client.meta.events.register(f"before-call.s3.{operation}", _to_trailer)


#: Factor applied to botocore's standard-mode retry delays by the ``fast_retries`` fixture.
FAST_RETRY_SCALE = 0.01


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> float:
    """Shrink botocore's retry backoff (standard and adaptive modes) for one test.

    Throttling retries otherwise sleep up to 1 s, 2 s, 4 s, ... (other errors 50 ms, 100 ms,
    ...), which makes fault-injection tests slow without testing anything more. Delays are
    multiplied by :data:`FAST_RETRY_SCALE`, which is returned. Legacy retry mode is not
    affected.
    """
    from botocore.retries import standard

    original = standard.ExponentialBackoff.delay_amount

    def scaled(self: Any, context: Any) -> float:
        return original(self, context) * FAST_RETRY_SCALE

    monkeypatch.setattr(standard.ExponentialBackoff, "delay_amount", scaled)
    return FAST_RETRY_SCALE


_FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
}
# Removed for the session so a developer's real session token or profile is never mixed
# with the fake keys.
_CLEARED_ENV = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE")


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Run moto's S3 server on 127.0.0.1 (a free port) and yield its ``http://`` URL.

    Fake credentials and region are put into the environment (for code that builds its own
    clients) and a developer's session token or profile is removed; all are restored afterwards.
    The server keeps every object in this process's memory. Used by the ``s3_server`` fixture and
    by the benchmark runner (benchmarks/run.py).
    """
    from moto.server import ThreadedMotoServer

    werkzeug_log = logging.getLogger("werkzeug")
    saved_level = werkzeug_log.level
    # moto's werkzeug logs a line per request at INFO.
    werkzeug_log.setLevel(logging.WARNING)
    saved_env = {name: os.environ.get(name) for name in (*_FAKE_ENV, *_CLEARED_ENV)}
    os.environ.update(_FAKE_ENV)
    for name in _CLEARED_ENV:
        os.environ.pop(name, None)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        # ThreadedMotoServer.stop() leaves the listening socket open.
        inner = getattr(server, "_server", None)
        if inner is not None:
            inner.server_close()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        werkzeug_log.setLevel(saved_level)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """moto's S3 server for the test session (see :func:`moto_server`); yields its URL."""
    with moto_server() as url:
        yield url


@pytest.fixture
def s3_bucket(s3_server: str) -> Iterator[str]:
    """Create a fresh bucket on ``s3_server`` and yield its name.

    Afterwards its objects are deleted, leftover multipart uploads aborted and the bucket
    removed, best effort, because moto keeps everything in this process's memory.
    """
    client = s3_client(s3_server)
    name = f"uc-test-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        _empty_and_delete_bucket(client, name)


def _empty_and_delete_bucket(client: BaseClient, name: str) -> None:
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            _delete_keys(client, name, [{"Key": o["Key"]} for o in page.get("Contents", [])])
        try:
            client.delete_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "BucketNotEmpty":
                raise
            # Only a test that turned versioning on leaves versions and delete markers.
            for page in client.get_paginator("list_object_versions").paginate(Bucket=name):
                entries = page.get("Versions", []) + page.get("DeleteMarkers", [])
                _delete_keys(client, name, [{"Key": e["Key"], "VersionId": e["VersionId"]} for e in entries])
            client.delete_bucket(Bucket=name)
    except Exception as exc:  # cleanup must not mask the test's own result
        log.warning("could not clean up bucket %s: %r", name, exc)


def _delete_keys(client: BaseClient, bucket: str, objects: list[dict[str, str]]) -> None:
    # One DeleteObjects call takes at most 1000 keys, as does one listing page.
    if objects:
        client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})


@pytest.fixture
def fault_proxy(s3_server: str) -> Iterator[FaultProxy]:
    """A started :class:`FaultProxy` in front of ``s3_server`` with no faults enabled."""
    with FaultProxy(s3_server) as proxy:
        yield proxy
