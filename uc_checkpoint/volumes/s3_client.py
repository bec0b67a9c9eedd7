"""The boto3 clients of :class:`~uc_checkpoint.volumes.s3.S3Volume`: how they are built, cached and
shared, our event handlers on them, and a response body received in place.

- :func:`make_client` builds a client from a volume's :class:`ClientSettings` (botocore's
  ``standard`` retries, timeouts, checksum and signing settings), reading botocore's service models
  through one loader per process.
- :data:`CLIENTS` (a :class:`ClientCache`) keeps one client per settings, environment and process;
  :class:`SharedClient` is the client a volume shares with the volumes made from it.
- :func:`hook_up` registers our handlers once per client: the retries behind each call
  (:class:`RetryCounter`), the part CRC-32s of multipart uploads (:class:`PartChecksums`), and no
  stored-checksum check of ranged GETs.
- :func:`read_body_into` receives a GET's body straight into the caller's buffers. It reads
  botocore's and urllib3's private attributes (``_raw_stream``, ``_fp``, ``_content_length``) and
  falls back to ``read()`` where they are missing.

A client is thread-safe. A forked child renews the cache's and the hooks' locks and starts without
its parent's clients (their connections are the parent's).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

from uc_checkpoint.format.integrity import crc32_base64
from uc_checkpoint.volumes.process_local import ProcessLocal


class RetryCounter:
    """The retries behind one boto3 client's successful calls (botocore's ``after-call`` hook feeds
    it), shared by every volume using that client. Thread-safe."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n

    def on_after_call(self, parsed: Any = None, **_: Any) -> None:
        """botocore ``after-call`` hook: the retries behind each successful call."""
        attempts = ((parsed or {}).get("ResponseMetadata") or {}).get("RetryAttempts") or 0
        if attempts:
            self.add(int(attempts))


def _renew_in_forked_child(owner: Any, renew: Callable[[Any], None]) -> None:
    """Call ``renew(owner)`` in every child forked from this process while ``owner`` lives (held
    weakly): a lock another thread held at the fork stays held in the child, and would be waited on
    forever."""
    ref = weakref.ref(owner)

    def in_child() -> None:
        alive = ref()
        if alive is not None:
            renew(alive)

    os.register_at_fork(after_in_child=in_child)


class PartChecksums:
    """The CRC-32 of every part of the multipart uploads in flight through one boto3 client, by
    bucket and key, handed to botocore as each ``UploadPart``'s ``ChecksumCRC32``. Thread-safe.

    s3transfer sends the parts and takes no per-part checksum, so botocore would compute each
    part's CRC-32 itself (zlib's, one more read of the staged file; docs/benchmarks-design.md,
    "Part checksums") though the staged file's digest already holds it. Only used where botocore
    signs the body anyway (see :meth:`~uc_checkpoint.volumes.s3.S3Volume._sends_own_crc`): the
    request is then the same either way (botocore puts what it computes in the same header). S3
    checks the part against it and refuses it (``BadDigest``) if they differ, so a wrong entry can
    fail an upload, never store a bad part. A part is given a
    CRC-32 only when exactly one upload of its key is announced and the part's length is the one
    announced; otherwise botocore computes it as before.
    """

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], list[list[tuple[int, int]]]] = {}
        self._lock = threading.Lock()
        _renew_in_forked_child(self, PartChecksums._forget_parent)

    def _forget_parent(self) -> None:
        # The parent's uploads are not the child's.
        self._lock = threading.Lock()
        self._by_key = {}

    @contextmanager
    def announced(self, bucket: str, key: str, parts: list[tuple[int, int]]) -> Iterator[None]:
        """Within the block, ``UploadPart`` requests for ``bucket``/``key`` carry ``parts[n - 1]``'s
        CRC-32 for part number ``n``; ``parts`` is ``(crc32, length in bytes)`` per part, in order."""
        where = (bucket, key)
        with self._lock:
            self._by_key.setdefault(where, []).append(parts)
        try:
            yield
        finally:
            with self._lock:
                entries = self._by_key[where]
                entries.remove(parts)
                if not entries:
                    del self._by_key[where]

    def on_upload_part(self, params: dict[str, Any], **_: Any) -> None:
        """botocore ``before-parameter-build.s3.UploadPart`` hook."""
        if params.get("ChecksumAlgorithm") != "CRC32" or "ChecksumCRC32" in params:
            return
        with self._lock:
            entries = self._by_key.get((params.get("Bucket", ""), params.get("Key", "")))
            parts = entries[0] if entries and len(entries) == 1 else None
        number = params.get("PartNumber")
        if parts is None or not isinstance(number, int) or not 1 <= number <= len(parts):
            return
        crc, length = parts[number - 1]
        try:
            sent = len(params["Body"])
        except (KeyError, TypeError):
            return
        if sent == length:
            params["ChecksumCRC32"] = crc32_base64(crc)


@dataclass
class ClientHooks:
    """What our event handlers on one boto3 client keep: its retries and the part CRC-32s of the
    multipart uploads in flight through it."""

    retries: RetryCounter
    part_checksums: PartChecksums


class _HookedClients:
    """Our hooks on each boto3 client, registered once per client however many volumes use it (a
    client given to several volumes, or a factory returning one client, would otherwise collect a
    set of handlers per volume). Holds the clients weakly."""

    def __init__(self) -> None:
        self._hooks: weakref.WeakKeyDictionary[Any, ClientHooks] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        _renew_in_forked_child(self, _HookedClients._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

    def hook_up(self, client: Any) -> ClientHooks:
        with self._lock:
            hooks = self._hooks.get(client)
            if hooks is None:
                hooks = ClientHooks(RetryCounter(), PartChecksums())
                client.meta.events.register("after-call.s3", hooks.retries.on_after_call)
                client.meta.events.register("before-call.s3.GetObject", _no_store_checksum_of_ranges)
                client.meta.events.register("before-parameter-build.s3.UploadPart", hooks.part_checksums.on_upload_part)
                self._hooks[client] = hooks
            return hooks


_HOOKED = _HookedClients()


def hook_up(client: Any) -> ClientHooks:
    """Our event handlers on ``client``, registered on its first call."""
    return _HOOKED.hook_up(client)


class ClientCache:
    """The boto3 clients this process built for volumes, by everything they were built from: the
    volume's client settings, every ``AWS_*`` environment variable (credentials, profile, endpoint,
    checksum settings) and the process id (a forked child never uses its parent's connections).

    A job that saves every few minutes builds a new writer, and so a new volume, for each save; a
    new client costs CPU (a botocore session registers its event handlers: docs/benchmarks-design.md,
    "S3 clients") and opens new connections (a TLS handshake each on real S3). fsspec caches
    filesystem instances for the same reason (``fsspec.spec._Cached``). boto3 clients are
    thread-safe, so volumes in any thread share one. At most ``size`` clients are kept (least recently used goes first; volumes
    holding it keep using it). Clients from a ``client`` or ``client_factory`` argument are never
    cached. An event handler registered on a shared client (``volume.client.meta.events``) reaches
    every volume sharing it: pass ``client_factory=`` for a client of one's own.
    """

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[Any, ...], tuple[Any, ClientHooks]] = OrderedDict()
        self._lock = threading.Lock()
        # The child starts with a lock of its own (another thread may have held this one, building
        # a client) and none of its parent's clients.
        _renew_in_forked_child(self, ClientCache._forget_parent)

    def _forget_parent(self) -> None:
        self._lock = threading.Lock()
        self._entries = OrderedDict()

    @staticmethod
    def key(settings: tuple[Any, ...]) -> tuple[Any, ...]:
        """The cache key of a client built from ``settings`` in this process, now: with every
        ``AWS_*`` environment variable and the size and modification time of the shared credentials
        and config files (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``, by default under
        ``~/.aws``), so that credentials rotated in either give a new client."""
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
        files = []
        for var, default in (("AWS_SHARED_CREDENTIALS_FILE", "credentials"), ("AWS_CONFIG_FILE", "config")):
            path = os.path.expanduser(os.environ.get(var) or os.path.join("~", ".aws", default))
            try:
                st = os.stat(path)
                files.append((path, st.st_size, st.st_mtime_ns))
            except OSError:
                files.append((path, -1, -1))
        return (os.getpid(), settings, hashlib.sha256(repr((env, files)).encode()).hexdigest())

    def get(self, settings: tuple[Any, ...], build: Callable[[], Any]) -> tuple[Any, ClientHooks]:
        """The client for ``settings`` and its hooks, built by ``build`` if none is cached."""
        key = self.key(settings)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
            # Built under the lock: two threads never build the same client twice.
            client = build()
            entry = (client, hook_up(client))
            self._entries[key] = entry
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
            return entry

    def clear(self) -> None:
        """Forget every cached client (volumes holding one keep it)."""
        with self._lock:
            self._entries.clear()


#: This process's shared clients (see :class:`ClientCache`).
CLIENTS = ClientCache()


class _ClientHere:
    """What a :class:`SharedClient` holds in one process: its client, that client's retry counter
    (and the count when it was taken), and the retries the volumes added themselves."""

    def __init__(self) -> None:
        self.client: Any = None
        self.hooks: ClientHooks | None = None
        self.base = 0
        self.own = 0
        self.client_lock = threading.Lock()  # one client is taken, even when threads race for it
        self.own_lock = threading.Lock()


class SharedClient:
    """What a volume shares with the volumes :meth:`~uc_checkpoint.volumes.s3.S3Volume.child` and
    :meth:`~uc_checkpoint.volumes.s3.S3Volume.with_location` make from it: one boto3 client
    (thread-safe, taken on first use by whichever of them needs it first, from :data:`CLIENTS`
    unless given) and the count of the retries its requests needed. Everything else (settings,
    the transfer manager) belongs to each volume. The client and its locks belong to one process
    (a :class:`~uc_checkpoint.volumes.process_local.ProcessLocal`): a forked child, or an unpickled
    volume, takes a client of its own and counts its own retries. A client given by the caller is
    kept in a forked child (the caller's to share or not).

    The retry count is what this volume family added itself (bodies cut off and fetched again)
    plus the client's retries since the family took the client: a client shared with volumes
    working at the same time counts their retries too.

    Args:
        client: a ready boto3 S3 client (the volume then refuses to be pickled), or None.
        retries: retries counted before (an unpickled volume's count).
    """

    def __init__(self, client: Any = None, *, retries: int = 0) -> None:
        self.given_client = client
        self._carried = retries
        self._here: ProcessLocal[_ClientHere] = ProcessLocal()
        if client is not None:
            self.take(None, None)

    @property
    def explicit_client(self) -> bool:
        """Whether the client was given by the caller."""
        return self.given_client is not None

    @property
    def client(self) -> Any:
        """This process's client if one was taken (None before first use)."""
        here = self._here.peek()
        return None if here is None else here.client

    @property
    def part_checksums(self) -> PartChecksums | None:
        """The part CRC-32 registry of this process's client (None before first use)."""
        here = self._here.peek()
        return None if here is None or here.hooks is None else here.hooks.part_checksums

    @property
    def retries(self) -> int:
        here = self._here.peek()
        if here is None:
            return self._carried
        client_retries = 0 if here.hooks is None else here.hooks.retries.count - here.base
        return self._carried + here.own + client_retries

    def add_retries(self, n: int) -> None:
        here = self._here.get(_ClientHere)
        with here.own_lock:
            here.own += n

    def take(self, factory: Callable[[], Any] | None, settings: ClientSettings | None) -> Any:
        """The shared client, taken on first use in this process: the one given, else from
        ``factory`` when given (never cached), else from :data:`CLIENTS` for ``settings``."""
        here = self._here.get(_ClientHere)
        with here.client_lock:
            if here.client is None:
                if self.given_client is not None:
                    client, hooks = self.given_client, hook_up(self.given_client)
                elif factory is not None:
                    client = factory()
                    hooks = hook_up(client)
                else:
                    assert settings is not None
                    client, hooks = CLIENTS.get(settings, functools.partial(make_client, settings))
                here.hooks, here.base, here.client = hooks, hooks.retries.count, client
            return here.client


@functools.cache
def _model_loader(data_path: str | None) -> Any:
    """This process's botocore data loader (service models, endpoint rules), shared by every
    client :func:`make_client` builds. botocore caches what a loader has read, per loader; the models
    never change while a process runs, so one loader per process reads each file once. A forked
    child inherits the cache, which stays valid (it holds no connections)."""
    from botocore.loaders import create_loader

    return create_loader(data_path)


class ClientSettings(NamedTuple):
    """What a volume's client is built from (with the environment, the :class:`ClientCache` key);
    the :class:`~uc_checkpoint.volumes.s3.S3Volume` arguments of the same names."""

    endpoint_url: str | None
    region_name: str | None
    addressing_style: str | None
    max_concurrency: int
    max_attempts: int
    connect_timeout: float
    read_timeout: float
    checksums: bool | None
    sign_payload: bool | None


def make_client(settings: ClientSettings) -> Any:
    """A new boto3 S3 client built from ``settings`` (boto3's credential chain, region and config
    file apply as usual), with a botocore session of its own."""
    import boto3
    import botocore.session
    from botocore.config import Config

    s3_options: dict[str, Any] = {"addressing_style": settings.addressing_style} if settings.addressing_style else {}
    if settings.sign_payload is not None:
        s3_options["payload_signing_enabled"] = settings.sign_payload
    # checksums=False also keeps botocore from adding checksum headers of its own (it does on
    # every PUT and GET by default), which stores that refuse them would reject.
    quiet = {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}
    config = Config(
        **(quiet if settings.checksums is False else {}),
        retries={"mode": "standard", "total_max_attempts": settings.max_attempts},
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        # Pool connections for every concurrent request: s3transfer's threads plus our own
        # ranged reads and HEADs.
        max_pool_connections=max(10, 2 * settings.max_concurrency + 4),
        s3=s3_options or None,
    )
    # A session per client (sessions are not safe to share between threads), all reading
    # botocore's service models through one loader per process: decoding those JSON files is
    # most of a client's construction (docs/benchmarks-design.md, "S3 clients").
    botocore_session = botocore.session.get_session()
    data_path = botocore_session.get_config_variable("data_path")  # AWS_DATA_PATH still applies
    botocore_session.register_component("data_loader", _model_loader(data_path))
    session = boto3.session.Session(botocore_session=botocore_session)
    return session.client("s3", endpoint_url=settings.endpoint_url, region_name=settings.region_name, config=config)


def _no_store_checksum_of_ranges(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    """botocore handler: a ranged GET's body is not checked against the object's stored CRC-32.

    botocore does that (``response_checksum_validation``) whenever the answer carries the stored
    checksum, which a range covering a whole object does: a second CRC-32 pass (zlib's; see
    docs/benchmarks-design.md, "S3 clients") over bytes that are checked against the manifest's
    block CRC-32s anyway, through a body wrapper that also keeps them from being received in place.
    Whole-object GETs (``.metadata``) keep botocore's check."""
    if "Range" in params.get("headers", {}):
        context.get("checksum", {}).pop("response_algorithms", None)


def read_body_into(body: Any, outs: Sequence[memoryview]) -> int:
    """Receive the response ``body`` into ``outs``, filled one after the other; returns the body's
    length in bytes (compare it with the views' total: more or fewer bytes than asked for).

    The bytes go from the socket into ``outs`` through the standard library's
    ``http.client.HTTPResponse.readinto`` under urllib3's response (botocore's ``StreamingBody``
    and urllib3's ``readinto`` both read into a new bytes object and copy it). Only a plain
    response is read that way: any wrapper (botocore's checksum-validating body), a content
    encoding or a chunked body goes through ``read()`` and one copy, as does a botocore or urllib3
    without those attributes.
    """
    from botocore.response import StreamingBody

    wanted = sum(map(len, outs))
    raw = getattr(body, "_raw_stream", None)  # urllib3.response.HTTPResponse
    fp = getattr(raw, "_fp", None)  # http.client.HTTPResponse
    plain = (
        type(body) is StreamingBody
        and callable(getattr(fp, "readinto", None))
        and not getattr(raw, "chunked", True)
        and not raw.headers.get("content-encoding")  # type: ignore[union-attr]
    )
    if not plain:
        data = memoryview(body.read())
        pos = 0
        for out in outs:
            n = max(0, min(len(out), len(data) - pos))
            out[:n] = data[pos : pos + n]
            pos += n
        return len(data)
    from http.client import IncompleteRead

    announced = getattr(body, "_content_length", None)
    got = 0
    try:
        for out in outs:
            filled = 0
            while filled < len(out):
                n = fp.readinto(out[filled:])  # type: ignore[union-attr]
                if not n:
                    break
                filled += n
            got += filled
            if filled < len(out):
                break
        if announced is not None and got < min(int(announced), wanted):
            # The connection ended before the body the store announced: cut off, not a short file.
            raise IncompleteRead(b"", int(announced) - got)
        # Reading on through urllib3 sees the end of the body (and returns the connection to its
        # pool), or hands back bytes beyond the range, which the caller reports.
        return got + len(raw.read())  # type: ignore[union-attr]
    except BaseException:
        raw.close()  # type: ignore[union-attr]  # a connection cut mid-body is not reused
        raise


__all__ = [
    "CLIENTS",
    "ClientCache",
    "ClientHooks",
    "ClientSettings",
    "PartChecksums",
    "RetryCounter",
    "SharedClient",
    "hook_up",
    "make_client",
    "read_body_into",
]
