"""A volume that is an S3 prefix (AWS or any S3-compatible store), through boto3 and s3transfer.

- Configuration is boto3's own: the credential chain, region, ``AWS_ENDPOINT_URL`` /
  ``AWS_ENDPOINT_URL_S3`` and ``~/.aws/config`` all apply unchanged; an explicit endpoint, region,
  addressing style, client factory or client may be passed instead.
- Multipart uploads go through one s3transfer ``TransferManager`` per volume object: files at or
  above ``multipart_threshold`` are sent as parts, concurrently, and ``max_concurrency`` bounds the
  requests in flight for all files of the process together. Parts are read from the staged file on
  demand, so memory stays at a few parts per thread. A smaller file is one ``PutObject``.
- Every upload is verified before it counts. A ``PutObject`` carries the staged file's CRC-32 (the
  one the manifest records, ``x-amz-checksum-crc32``), which S3 checks against the body before storing it; an
  answer that carries it back proves the object. Otherwise (multipart uploads, stores that echo
  no checksum) a HEAD checks the object's size, and its CRC-32 as the store reports it (whole-object
  or S3's composite multipart form) against the CRC-32 computed locally. Stores that keep no
  checksum are verified by size; readers still check the CRC-32s recorded in ``.metadata``.
- ``.metadata`` is published with a single ``PutObject`` (atomic per object); never a
  copy-and-delete "rename". With ``overwrite=False`` the PUT carries ``If-None-Match: *``.
- Retries: botocore's ``standard`` mode (exponential backoff with jitter, at most 20 s between
  attempts) on throttling (503 SlowDown), 5xx, connection errors and timeouts, at most
  ``max_attempts`` attempts per request; a body cut off mid-download is retried here the same way.
  Worst case per request: ``max_attempts * (connect_timeout + read_timeout + 20 s)``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import random
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from uc_checkpoint.errors import CheckpointExistsError, CorruptCheckpointError, TransferError, VolumeError
from uc_checkpoint.format.integrity import Digest, FileRecord, composite_crc32_base64, crc32, crc32_base64, digest_file
from uc_checkpoint.format.layout import is_checkpoint_file
from uc_checkpoint.volumes.base import Entry, Volume
from uc_checkpoint.volumes.locations import canonical_key_path, check_bucket_name
from uc_checkpoint.volumes.workers import Workers

logger = logging.getLogger(__name__)
_R = TypeVar("_R")

#: Files at or above this size (bytes) are uploaded as multipart uploads; smaller ones with one
#: ``PutObject``. Twice the part size: a data file is its tensors plus a few KiB of archive records,
#: and at one part size a 16 MiB tensor's file became a 16 MiB part, a part of a few KiB, and the
#: create and complete requests around them (5 requests where 1 does).
DEFAULT_MULTIPART_THRESHOLD = 32 << 20
#: Bytes per multipart part (s3transfer raises it for files that would need over 10,000 parts).
DEFAULT_PART_SIZE = 16 << 20
#: Requests in flight per volume object (all files of one save on one rank together).
DEFAULT_MAX_CONCURRENCY = 8
#: Attempts per request, first one included.
DEFAULT_MAX_ATTEMPTS = 8


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
    part's CRC-32 itself (zlib's, one more read of the staged file: ~0.3 CPU-s per GiB here) though
    the staged file's digest already holds it. Only used where botocore signs the body anyway (see
    :meth:`S3Volume._sends_own_crc`): the request is then the same either way (botocore puts what it
    computes in the same header). S3 checks the part against it and refuses it (``BadDigest``) if
    they differ, so a wrong entry can fail an upload, never store a bad part. A part is given a
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


def _hook_up(client: Any) -> ClientHooks:
    """Our event handlers on ``client``, registered on its first call."""
    return _HOOKED.hook_up(client)


class ClientCache:
    """The boto3 clients this process built for volumes, by everything they were built from: the
    volume's client settings, every ``AWS_*`` environment variable (credentials, profile, endpoint,
    checksum settings) and the process id (a forked child never uses its parent's connections).

    A job that saves every few minutes builds a new writer, and so a new volume, for each save; a
    new client costs ~13 ms of CPU here (a botocore session registers ~1,300 event handlers) and
    opens new connections (a TLS handshake each on real S3). fsspec caches filesystem instances for
    the same reason (``fsspec.spec._Cached``). boto3 clients are thread-safe, so volumes in any
    thread share one. At most ``size`` clients are kept (least recently used goes first; volumes
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
            entry = (client, _hook_up(client))
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


class _Shared:
    """What a volume shares with the volumes :meth:`S3Volume.child` and
    :meth:`S3Volume.with_location` make from it: one boto3 client
    (thread-safe, taken on first use by whichever of them needs it first, from :data:`CLIENTS`
    unless given) and the count of the retries its requests needed. Everything else (settings,
    the transfer manager) belongs to each volume. Holds locks and a client, so it never crosses
    processes: an unpickled volume starts a new one.

    The retry count is what this volume family added itself (bodies cut off and fetched again)
    plus the client's retries since the family took the client: a client shared with volumes
    working at the same time counts their retries too.

    Args:
        client: a ready boto3 S3 client (the volume then refuses to be pickled), or None.
    """

    def __init__(self, client: Any = None) -> None:
        self.pid = os.getpid()
        self.client: Any = None
        self.explicit_client = client is not None
        self.client_lock = threading.Lock()  # one client is taken, even when threads race for it
        self._own = 0
        self._own_lock = threading.Lock()
        self._counter: RetryCounter | None = None
        self._base = 0
        self.part_checksums: PartChecksums | None = None
        if client is not None:
            self.bind(client, _hook_up(client))

    def bind(self, client: Any, hooks: ClientHooks) -> None:
        self.client, self._counter, self._base = client, hooks.retries, hooks.retries.count
        self.part_checksums = hooks.part_checksums

    @property
    def retries(self) -> int:
        client_retries = 0 if self._counter is None else self._counter.count - self._base
        return self._own + client_retries

    def add_retries(self, n: int) -> None:
        with self._own_lock:
            self._own += n


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``.

    The prefix is taken verbatim (no URL decoding: ``%``, ``#``, ``?``, ``+`` and spaces are key
    characters like any other), in its canonical form (:mod:`uc_checkpoint.volumes.locations`):
    empty segments and trailing slashes dropped.

    Raises:
        VolumeError: not an ``s3://`` URL, no bucket, a bucket name S3 does not allow, or a ``.``
            or ``..`` segment in the prefix.
    """
    if not url.startswith("s3://"):
        raise VolumeError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise VolumeError(f"S3 URL {url!r} names no bucket")
    return check_bucket_name(bucket, url), canonical_key_path(prefix, url).lstrip("/")


@functools.cache
def _model_loader(data_path: str | None) -> Any:
    """This process's botocore data loader (service models, endpoint rules), shared by every
    client :class:`S3Volume` makes. botocore caches what a loader has read, per loader; the models
    never change while a process runs, so one loader per process reads each file once. A forked
    child inherits the cache, which stays valid (it holds no connections)."""
    from botocore.loaders import create_loader

    return create_loader(data_path)


class S3Volume(Volume):
    """A checkpoint location ``s3://bucket/prefix``; each file is the object ``prefix/<name>``.

    Args:
        url: ``s3://bucket/prefix``.
        endpoint_url: S3 endpoint (default: boto3's resolution, including ``AWS_ENDPOINT_URL_S3``
            and ``AWS_ENDPOINT_URL``).
        region_name: region (default: boto3's resolution).
        addressing_style: ``"path"``, ``"virtual"`` or ``"auto"`` (default: boto3's, from the
            config file; many self-hosted stores need ``"path"``).
        client_factory: a picklable callable returning a boto3 S3 client; used instead of building
            one (and again in each process DCP's PROCESS mode starts).
        client: a ready boto3 S3 client. It cannot cross processes: a volume holding one refuses to
            be pickled (use ``client_factory`` for ``async_save`` in PROCESS mode).
        multipart_threshold: files of at least this many bytes are uploaded in parts.
        part_size: bytes per part.
        max_concurrency: requests in flight for this volume object (bounded memory: about
            ``max_concurrency * part_size`` bytes of buffers at most).
        max_attempts: attempts per request (retries with exponential backoff and jitter).
        connect_timeout: seconds to open a connection.
        read_timeout: seconds without data before a response is given up (then retried).
        checksums: ask the store to check and keep a CRC-32 of every object (``x-amz-checksum-*``
            and ``x-amz-sdk-checksum-algorithm`` headers, and ``x-amz-checksum-mode`` to read it
            back). None (default): follow boto3's own settings, ``request_checksum_calculation`` and
            ``response_checksum_validation`` (``AWS_REQUEST_CHECKSUM_CALCULATION`` /
            ``AWS_RESPONSE_CHECKSUM_VALIDATION`` or the config file): ``when_required`` sends none of
            those headers, for stores that refuse them. Without store checksums, uploads are verified
            by size, and every byte read is still checked against the manifest's CRC-32s.
        sign_payload: whether SigV4 signs each request body (a SHA-256 of every byte sent, and a
            second read of each staged file for it: up to a third of a save's client CPU on a
            plain-HTTP store, the ``uc-s3-unsigned`` rows of docs/benchmarks.md). botocore signs bodies only over
            plain ``http://`` (over ``https`` the CRC-32 and TLS stand in for it); None (default)
            keeps that. False skips it on a plain-HTTP endpoint too (the body's CRC-32 is still sent
            and checked by the store), as s3torchconnector's CRT client always does: for a store
            inside the cluster where nobody can alter traffic in flight. True signs always.

    Raises:
        VolumeError: ``url`` is not ``s3://bucket/...``.

    (Over 250 lines: the client's lifetime and checksum settings, s3transfer's uploads and downloads
    with their verification, and the error mapping of each S3 call; splitting them would spread one
    store's behaviour over several classes.)
    """

    prefers_ranged_reads = True
    partitions_by_prefix = True
    verifies_uploads = True  # every upload: CRC-32 in the PUT's answer, or a HEAD (_verify_upload)

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        addressing_style: str | None = None,
        client_factory: Callable[[], Any] | None = None,
        client: Any = None,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        checksums: bool | None = None,
        sign_payload: bool | None = None,
    ) -> None:
        if checksums is not None and not isinstance(checksums, bool):
            raise VolumeError(f"checksums must be True, False or None, got {checksums!r}")
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        if addressing_style not in (None, "path", "virtual", "auto"):
            raise ValueError(f"addressing_style must be 'path', 'virtual' or 'auto', got {addressing_style!r}")
        for arg, value in (
            ("multipart_threshold", multipart_threshold),
            ("part_size", part_size),
            ("max_concurrency", max_concurrency),
            ("max_attempts", max_attempts),
        ):
            if value < 1:
                raise ValueError(f"{arg} must be >= 1, got {value}")
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.addressing_style = addressing_style
        self.client_factory = client_factory
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.checksums = checksums
        if sign_payload is not None and not isinstance(sign_payload, bool):
            raise VolumeError(f"sign_payload must be True, False or None, got {sign_payload!r}")
        self.sign_payload = sign_payload
        self._shared = _Shared(client)
        self._transfer: Any = None
        self._transfer_pid = 0
        self._lock = threading.Lock()  # guards this volume's transfer manager

    def __repr__(self) -> str:
        return f"S3Volume({self.url!r})"

    def _settings(self) -> dict[str, Any]:
        """The constructor's keyword arguments this volume was built with (but the client)."""
        return {
            "endpoint_url": self.endpoint_url,
            "region_name": self.region_name,
            "addressing_style": self.addressing_style,
            "client_factory": self.client_factory,
            "multipart_threshold": self.multipart_threshold,
            "part_size": self.part_size,
            "max_concurrency": self.max_concurrency,
            "max_attempts": self.max_attempts,
            "connect_timeout": self.connect_timeout,
            "read_timeout": self.read_timeout,
            "checksums": self.checksums,
            "sign_payload": self.sign_payload,
        }

    @property
    def _client(self) -> Any:
        """The client if one was built or given (None before first use)."""
        return self._shared.client

    @property
    def retries(self) -> int:
        """Requests retried so far by this volume's client, counted with its :meth:`child` volumes.

        botocore's retries of each call, plus bodies cut off and fetched again."""
        return self._shared.retries

    def __getstate__(self) -> dict[str, Any]:
        if self._shared.explicit_client:
            raise VolumeError(
                f"S3Volume({self.url}) holds a boto3 client, which cannot be sent to another process "
                "(DCP's PROCESS mode pickles the storage writer); pass client_factory= or endpoint_url= "
                "instead"
            )
        state = dict(self.__dict__)
        state["_shared"] = self._shared.retries  # the count travels; the client and locks do not
        state["_transfer"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        retries = state.pop("_shared")
        self.__dict__.update(state)
        self._shared = _Shared()
        self._shared.add_retries(retries)
        self._lock = threading.Lock()

    def _send_checksums(self) -> bool:
        """Whether uploads carry a CRC-32 for the store to check and keep."""
        if self.checksums is not None:
            return self.checksums
        return getattr(self.client.meta.config, "request_checksum_calculation", "when_supported") != "when_required"

    def _sends_own_crc(self) -> bool:
        """Whether an upload puts the staged file's CRC-32 (or its part's) in the request itself, so
        that botocore computes none: only where botocore signs the body anyway or is told not to.

        Over ``https`` with ``sign_payload`` unset, botocore sends an upload with its CRC-32 in an
        aws-chunked trailer, computed as the body streams, and leaves the body unsigned. A CRC-32
        given in the header instead makes it sign the body (a SHA-256 of every byte, several times
        the CRC's cost), so there the store checks botocore's trailer, which the store's answer or a
        HEAD then shows to be the staged file's CRC-32."""
        if self.sign_payload is not None:
            return True
        return not str(self.client.meta.endpoint_url).lower().startswith("https:")

    def _read_checksums(self) -> bool:
        """Whether HEADs ask for the stored CRC-32 (``x-amz-checksum-mode``)."""
        if self.checksums is not None:
            return self.checksums
        return getattr(self.client.meta.config, "response_checksum_validation", "when_supported") != "when_required"

    # ---- clients (created on first use) -------------------------------------------------------
    @property
    def client(self) -> Any:
        """The boto3 S3 client (built on first use, shared with :meth:`child` volumes)."""
        shared = self._shared
        if shared.pid != os.getpid() and not shared.explicit_client:
            # Inherited through fork: the parent's client (its connections) and locks stay there.
            fresh = _Shared()
            fresh.add_retries(shared.retries)
            shared = self._shared = fresh
        with shared.client_lock:
            if shared.client is None:
                if self.client_factory is not None:
                    client = self.client_factory()
                    shared.bind(client, _hook_up(client))
                else:
                    shared.bind(*CLIENTS.get(self._client_settings(), self._make_client))
            return shared.client

    def _client_settings(self) -> tuple[Any, ...]:
        """What this volume's client is built from (the :class:`ClientCache` key, with the environment)."""
        return (
            self.endpoint_url,
            self.region_name,
            self.addressing_style,
            self.max_concurrency,
            self.max_attempts,
            self.connect_timeout,
            self.read_timeout,
            self.checksums,
            self.sign_payload,
        )

    def _make_client(self) -> Any:
        import boto3
        import botocore.session
        from botocore.config import Config

        s3_options: dict[str, Any] = {"addressing_style": self.addressing_style} if self.addressing_style else {}
        if self.sign_payload is not None:
            s3_options["payload_signing_enabled"] = self.sign_payload
        # checksums=False also keeps botocore from adding checksum headers of its own (it does on
        # every PUT and GET by default), which stores that refuse them would reject.
        quiet = {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}
        config = Config(
            **(quiet if self.checksums is False else {}),
            retries={"mode": "standard", "total_max_attempts": self.max_attempts},
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            # Pool connections for every concurrent request: s3transfer's threads plus our own
            # ranged reads and HEADs.
            max_pool_connections=max(10, 2 * self.max_concurrency + 4),
            s3=s3_options or None,
        )
        # A session per client (sessions are not safe to share between threads), all reading
        # botocore's service models through one loader per process: decoding those JSON files is
        # most of a client's construction (~0.1 s of CPU), which every save of a new writer paid.
        botocore_session = botocore.session.get_session()
        data_path = botocore_session.get_config_variable("data_path")  # AWS_DATA_PATH still applies
        botocore_session.register_component("data_loader", _model_loader(data_path))
        session = boto3.session.Session(botocore_session=botocore_session)
        return session.client("s3", endpoint_url=self.endpoint_url, region_name=self.region_name, config=config)

    @property
    def transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.part_size,
            max_concurrency=self.max_concurrency,
            use_threads=True,
        )

    def _transfer_manager(self) -> Any:
        client = self.client
        with self._lock:
            # A forked child inherits the parent's manager but not its worker threads: a transfer
            # submitted there would wait forever.
            if self._transfer is None or self._transfer_pid != os.getpid():
                from s3transfer.manager import TransferManager

                # Our threads, not ThreadPoolExecutor's: a save running while the interpreter exits
                # goes on uploading (see uc_checkpoint.volumes.workers).
                self._transfer = TransferManager(client, self.transfer_config, executor_cls=Workers)
                self._transfer_pid = os.getpid()
            return self._transfer

    def close(self) -> None:
        with self._lock:
            transfer, self._transfer = self._transfer, None
        if transfer is not None and self._transfer_pid == os.getpid():
            transfer.shutdown()

    # ---- names --------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        """The object key of file ``name``."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def _dir_prefix(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def child(self, name: str) -> S3Volume:
        """The prefix ``prefix/name``, built by the constructor with this volume's settings. It
        shares this volume's client (boto3 clients are thread-safe) and retry count; it has its own
        transfer manager, so ``max_concurrency`` bounds each volume object's requests."""
        return self._at(f"{self.url}/{name}")

    def with_location(self, location: str) -> S3Volume | None:
        """An ``s3://`` URL (any bucket) as a volume with this one's settings and client, as
        :meth:`child` builds them; None for any other location."""
        return self._at(location) if location[:5].lower() == "s3://" else None

    def _at(self, url: str) -> S3Volume:
        other = S3Volume(url, **self._settings())
        other._shared = self._shared
        return other

    # ---- checks -------------------------------------------------------------------------------
    def prepare_for_write(self, create_parents: bool = True) -> None:
        """Nothing to prepare and no request: S3 has no directories, and a save lists its location
        right after this (``ListObjectsV2`` needs the same ``s3:ListBucket`` permission as
        ``HeadBucket``), which reports a missing or forbidden bucket by name (:meth:`_scan`)."""

    def _scan(self) -> list[Entry]:
        """``ListObjectsV2`` with delimiter ``/``, every page: objects with their size and
        ``LastModified``, common prefixes as sub-locations. An empty prefix is an empty list."""
        prefix = self._dir_prefix()
        out: list[Entry] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix) :]
                    if name:
                        out.append(Entry(name, int(obj["Size"]), obj["LastModified"].timestamp()))
                for sub in page.get("CommonPrefixes", []):
                    out.append(Entry(sub["Prefix"][len(prefix) :], -1))
        except Exception as exc:  # noqa: BLE001
            status, code = _error_info(exc)
            if code == "NoSuchBucket" or (status == 404 and code in ("404", "NotFound")):
                raise VolumeError(f"cannot list {self.url}: bucket {self.bucket!r} does not exist") from exc
            if status == 403:
                raise VolumeError(f"cannot list {self.url}: access to bucket {self.bucket!r} denied: {exc}") from exc
            raise TransferError(f"listing {self.url} failed: {exc}") from exc
        return out

    def exists(self) -> bool:
        """``True`` without a request: a prefix is never missing (S3 has no directories), and a
        missing bucket is reported by the first listing or write.

        Raises:
            Nothing.
        """
        return True

    def size(self, name: str) -> int | None:
        head = self._head(name)
        return None if head is None else int(head["ContentLength"])

    def _head(self, name: str) -> dict[str, Any] | None:
        """The HeadObject answer for ``name``, None when it does not exist.

        Raises:
            TransferError: the HEAD failed otherwise.
        """
        try:
            head: dict[str, Any] = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as exc:  # noqa: BLE001
            if _is_missing(exc):
                return None
            raise TransferError(f"HEAD {self.url_of(name)} failed: {exc}{_hint(exc)}") from exc
        return head

    # ---- data movement ------------------------------------------------------------------------
    def _effective_part_size(self, size: int) -> int:
        from s3transfer.utils import ChunksizeAdjuster

        return ChunksizeAdjuster().adjust_chunksize(self.part_size, size)

    def upload_file(self, local_path: Path, name: str, *, sync: bool = True) -> FileRecord:
        where = self.url_of(name)
        size = local_path.stat().st_size
        multipart = size >= self.multipart_threshold
        digest = digest_file(local_path, part_size=self._effective_part_size(size) if multipart else None)
        record = digest.record(name)
        extra = {"ChecksumAlgorithm": "CRC32"} if self._send_checksums() else {}
        try:
            if multipart:
                with self._announce_parts(name, digest, size, bool(extra)):
                    future = self._transfer_manager().upload(
                        str(local_path), self.bucket, self.key(name), extra_args=extra
                    )
                    future.result()
                proven = False  # s3transfer's future does not hand back CompleteMultipartUpload's answer
            else:
                proven = self._put_file(local_path, name, record, checksum=bool(extra))
        except TransferError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"uploading {local_path} to {where} failed: {exc}{_hint(exc)}") from exc
        if not proven:
            self._verify_upload(name, record, digest, multipart)
        return record

    def _announce_parts(self, name: str, digest: Digest, size: int, checksum: bool) -> AbstractContextManager[None]:
        """While the block runs, the multipart upload of ``name`` sends the part CRC-32s of
        ``digest`` (a staged file of ``size`` bytes) instead of botocore computing them again
        (:class:`PartChecksums`); a no-op without ``checksum`` or where botocore sends its own CRC-32
        in a trailer (:meth:`_sends_own_crc`)."""
        if not checksum or not self._sends_own_crc():
            return nullcontext()
        registry = self._shared.part_checksums  # bound by _sends_own_crc's use of the client
        part_size = self._effective_part_size(size)
        if registry is None or not digest.part_crc32:
            return nullcontext()
        lengths = [min(part_size, size - start) for start in range(0, size, part_size)]
        if len(lengths) != len(digest.part_crc32):
            return nullcontext()
        return registry.announced(self.bucket, self.key(name), list(zip(digest.part_crc32, lengths)))

    def _put_file(self, local_path: Path, name: str, record: FileRecord, *, checksum: bool) -> bool:
        """Upload a file below the multipart threshold with one ``PutObject``; True when the store's
        answer proves the bytes landed (it carries the CRC-32 sent).

        With ``checksum``, the staged file's CRC-32 (``record``'s, which the manifest keeps) goes in
        ``x-amz-checksum-crc32`` where :meth:`_sends_own_crc` (botocore then computes none of its
        own, one pass over the bytes fewer; elsewhere botocore's trailer carries the CRC-32 of what it
        read). S3 checks the body against it, refusing the object (``BadDigest``) when a byte changed
        on the way, so a 200 carrying the staged file's CRC-32 needs no HEAD to confirm it.

        Raises:
            TransferError: the store stored another CRC-32 than the one sent.
        """
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(name)}
        sent = crc32_base64(int(record.crc32, 16))
        if checksum:
            kwargs["ChecksumAlgorithm"] = "CRC32"
            if self._sends_own_crc():
                kwargs["ChecksumCRC32"] = sent
        with open(local_path, "rb") as body:  # botocore seeks back to the start for a retry
            response = self.client.put_object(Body=body, **kwargs)
        reported = response.get("ChecksumCRC32")
        if reported and reported != sent:
            raise TransferError(
                f"{self.url_of(name)} was stored with CRC-32 {reported}, expected {sent} "
                "(corrupted in transit or overwritten)"
            )
        return checksum and bool(reported)

    def _verify_upload(self, name: str, record: FileRecord, digest: Digest, multipart: bool) -> None:
        where = self.url_of(name)
        mode = {"ChecksumMode": "ENABLED"} if self._read_checksums() else {}
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(name), **mode)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"verifying {where} after upload failed: {exc}{_hint(exc)}") from exc
        landed = int(head["ContentLength"])
        if landed != record.size:
            raise TransferError(f"{where} landed with {landed} bytes, expected {record.size}")
        reported = head.get("ChecksumCRC32")
        if not reported:
            logger.debug("%s: the store reports no CRC-32; verified by size", where)
            return
        reported = reported.split("-")[0]  # composite checksums may carry a "-<parts>" suffix
        accepted = {crc32_base64(int(record.crc32, 16))}
        if multipart:
            accepted.add(composite_crc32_base64(digest.part_crc32))
        if reported not in accepted:
            raise TransferError(
                f"{where} landed with CRC-32 {reported}, expected {' or '.join(sorted(accepted))} "
                "(corrupted in transit or overwritten)"
            )

    def download_file(
        self, name: str, local_path: Path, *, expected_size: int | None = None, min_size: int = 0
    ) -> FileRecord:
        from s3transfer.subscribers import BaseSubscriber

        where = self.url_of(name)
        actual = self.size(name)
        size = self._check_size(name, actual, expected_size, min_size)
        if size != actual:  # only the items' bytes of a file without a manifest record
            local_path.write_bytes(self.read_range(name, 0, size))
            return digest_file(local_path).record(name)

        class _KnownSize(BaseSubscriber):  # s3transfer then plans from our HEAD instead of its own
            def on_queued(self, future: Any, **kwargs: Any) -> None:
                future.meta.provide_transfer_size(size)

        try:
            self._transfer_manager().download(
                self.bucket, self.key(name), str(local_path), subscribers=[_KnownSize()]
            ).result()
        except Exception as exc:  # noqa: BLE001
            if _is_missing(exc):
                raise self._missing(name) from exc
            raise TransferError(f"downloading {where} to {local_path} failed: {exc}") from exc
        record = digest_file(local_path).record(name)
        self._check_copied(name, record.size, size)
        return record

    def read_range(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        data = self._get_range(name, start, end, lambda body: body.read())
        if len(data) != end - start:
            raise self._truncated(name, start, end, len(data))
        return data

    def read_range_into(
        self, name: str, start: int, out: memoryview | Sequence[memoryview], *, file_size: int | None = None
    ) -> None:
        """As :meth:`Volume.read_range_into`, the response body received straight into ``out``
        (where botocore's ``read`` would build a bytes object of it first: one pass over every
        byte, and fresh memory that the kernel must map and zero); ``file_size`` is checked
        against the object's size in the response's ``Content-Range`` (no extra request)."""
        views = [out] if isinstance(out, memoryview) else list(out)
        nbytes = sum(map(len, views))
        if nbytes:
            end = start + nbytes
            got = self._get_range(name, start, end, lambda body: _read_body_into(body, views), file_size)
            if got != nbytes:
                raise self._truncated(name, start, end, got)

    def _get_range(
        self, name: str, start: int, end: int, receive: Callable[[Any], _R], file_size: int | None = None
    ) -> _R:
        try:
            return self._get(name, f"bytes={start}-{end - 1}", receive, file_size)
        except CorruptCheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            if _is_missing(exc):
                raise self._missing(name) from exc
            status, code = _error_info(exc)
            if status == 416 or code == "InvalidRange":
                raise CorruptCheckpointError(
                    f"checkpoint file {self.url_of(name)} is truncated: it ends before byte {start}"
                ) from exc
            raise TransferError(
                f"reading bytes {start}-{end - 1} of {self.url_of(name)} failed: {exc}{_hint(exc)}"
            ) from exc

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self._get(name, None)
        except Exception as exc:  # noqa: BLE001
            if _error_info(exc)[1] == "NoSuchBucket":
                raise VolumeError(f"cannot read {self.url}: bucket {self.bucket!r} does not exist") from exc
            if _is_missing(exc):
                return None
            raise TransferError(f"reading {self.url_of(name)} failed: {exc}{_hint(exc)}") from exc

    def _get(
        self,
        name: str,
        byte_range: str | None,
        receive: Callable[[Any], _R] | None = None,
        file_size: int | None = None,
    ) -> _R:
        """GET an object (or a range of it) and hand its body to ``receive`` (default: read it
        whole). botocore retries a failed request; a body cut off after the response started is
        retried here, with the same backoff shape. With ``file_size``, a ranged response whose
        ``Content-Range`` gives the object another size raises CorruptCheckpointError before the
        body is read."""
        from http.client import IncompleteRead

        from botocore.exceptions import (
            ConnectionClosedError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        cut_off = (
            ResponseStreamingError,
            IncompleteReadError,
            ReadTimeoutError,
            ConnectionClosedError,
            IncompleteRead,  # from a body received straight into the caller's buffer
            ConnectionError,
            TimeoutError,
        )
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(name)}
        if byte_range:
            kwargs["Range"] = byte_range
        for attempt in range(1, self.max_attempts + 1):
            try:
                response = self.client.get_object(**kwargs)
                if file_size is not None:
                    self._check_object_size(name, response, file_size)
                return receive(response["Body"]) if receive is not None else response["Body"].read()
            except cut_off as exc:
                if attempt == self.max_attempts:
                    raise
                delay = random.uniform(0, min(20.0, 0.1 * 2**attempt))  # full jitter
                logger.debug("GET %s cut off (%s); retry %d in %.2f s", self.url_of(name), exc, attempt, delay)
                self._shared.add_retries(1)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _check_object_size(self, name: str, response: Mapping[str, Any], file_size: int) -> None:
        """Raise CorruptCheckpointError when a ranged GET's ``Content-Range`` (``bytes a-b/total``)
        gives another object size than ``file_size``; a store that sends no total is not checked."""
        total = str(response.get("ContentRange") or "").rpartition("/")[2]
        if total.isdigit() and int(total) != file_size:
            response["Body"].close()  # the range's bytes are of no use: do not read them
            self._check_size(name, int(total), file_size, 0)

    def publish_bytes(self, name: str, data: bytes, *, overwrite: bool = True) -> bool:
        response = self._put_small(name, data, overwrite=overwrite)
        # S3 is read-after-write consistent: a 200 carrying the CRC-32 of these bytes, or an ETag that
        # is their MD5 (S3's ETag of a single-part object without KMS or customer-key encryption, and
        # that of stores that keep no checksums), is the store's own word that they are what a GET
        # now returns, so the publish needs no read-back. Another ETag proves nothing either way.
        return bool(response.get("ChecksumCRC32")) or _etag_is_md5_of(response.get("ETag"), data)

    def write_tagged(self, name: str, data: bytes) -> str | None:
        return self._put_small(name, data, overwrite=True).get("ETag")

    def _put_small(self, name: str, data: bytes, *, overwrite: bool) -> dict[str, Any]:
        """One PutObject of ``data`` (with a CRC-32 the store checks, unless checksums are off);
        its answer, whose CRC-32 (when the store reports one) was checked against the bytes sent.

        Raises:
            CheckpointExistsError: ``overwrite=False`` and the object exists.
            TransferError: the PUT failed, or the store stored another CRC-32.
        """
        where = self.url_of(name)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(name), "Body": data}
        if self._send_checksums():
            kwargs["ChecksumAlgorithm"] = "CRC32"
        if not overwrite:
            kwargs["IfNoneMatch"] = "*"
        try:
            response: dict[str, Any] = self.client.put_object(**kwargs)
        except Exception as exc:  # noqa: BLE001
            status, code = _error_info(exc)
            if not overwrite and (status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict")):
                raise CheckpointExistsError(f"{where} already exists and overwrite=False") from exc
            if not overwrite and (status == 501 or code == "NotImplemented"):
                raise TransferError(
                    f"publishing {where} failed: the store does not support conditional writes (If-None-Match), "
                    f"which overwrite=False needs; save with overwrite=True (the default): {exc}"
                ) from exc
            raise TransferError(f"publishing {where} failed: {exc}{_hint(exc)}") from exc
        reported = response.get("ChecksumCRC32")
        if reported and reported != crc32_base64(crc32(data)):
            raise TransferError(f"{where} was stored with CRC-32 {reported}, which does not match the bytes sent")
        return response

    def tag_of(self, name: str) -> str | None:
        head = self._head(name)
        return None if head is None else head.get("ETag")

    def delete(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as exc:  # noqa: BLE001
            if _is_missing(exc):
                return
            raise TransferError(f"deleting {self.url_of(name)} failed: {exc}") from exc

    def abort_incomplete_uploads(
        self, older_than_s: float | None = None, keep: Callable[[str], bool] | None = None
    ) -> int:
        prefix = self._dir_prefix()
        aborted = 0
        cutoff = None if older_than_s is None else time.time() - older_than_s
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for upload in page.get("Uploads", []):
                    name = upload["Key"][len(prefix) :]
                    if not _at_location(name) or (keep is not None and keep(name)):
                        continue  # belongs to a location below this one, or the caller keeps it
                    if cutoff is not None and upload["Initiated"].timestamp() > cutoff:
                        continue  # recent: a save may still be sending parts
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
        except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a save
            logger.warning("could not abort incomplete uploads under %s: %s", self.url, exc)
        return aborted


def _etag_is_md5_of(etag: str | None, data: bytes) -> bool:
    """Whether ``etag`` (as S3 answers it, in quotes) is the MD5 of ``data``: what stores that keep
    no CRC-32 report for an object written by one PUT (MD5 only names content here, not a secret)."""
    return etag is not None and etag.strip('"').lower() == hashlib.md5(data, usedforsecurity=False).hexdigest()


def _no_store_checksum_of_ranges(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    """botocore handler: a ranged GET's body is not checked against the object's stored CRC-32.

    botocore does that (``response_checksum_validation``) whenever the answer carries the stored
    checksum, which a range covering a whole object does: a second CRC-32 pass (zlib's, ~14% of a
    load's client CPU measured) over bytes that are checked against the manifest's block CRC-32s
    anyway, through a body wrapper that also keeps them from being received in place. Whole-object
    GETs (``.metadata``) keep botocore's check."""
    if "Range" in params.get("headers", {}):
        context.get("checksum", {}).pop("response_algorithms", None)


def _at_location(name: str) -> bool:
    """Whether the key ``name`` (relative to a location) is a file of that location: directly in
    it, or a data file in one of its spread prefixes (:func:`uc_checkpoint.format.layout.spread_dir`),
    not something of a location below it."""
    return "/" not in name or is_checkpoint_file(name)


def _read_body_into(body: Any, outs: Sequence[memoryview]) -> int:
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


def _hint(exc: BaseException) -> str:
    """What to change when a store refuses boto3's checksum headers (as several S3-compatible
    stores do, with 400 InvalidArgument "Unsupported header 'x-amz-sdk-checksum-algorithm'"),
    or "" for any other error."""
    status, code = _error_info(exc)
    text = str(exc).lower()
    # A HEAD's error has no body: a bare "Bad Request", after asking for the checksum (x-amz-checksum-mode).
    bare_head = status == 400 and "headobject" in text and code in ("400", "BadRequest", "")
    if bare_head or (
        status in (400, 501)
        and "checksum" in text
        and ("header" in text or code in ("InvalidArgument", "NotImplemented"))
    ):
        return (
            " (the store refuses S3's checksum headers: set AWS_REQUEST_CHECKSUM_CALCULATION=when_required and "
            "AWS_RESPONSE_CHECKSUM_VALIDATION=when_required, or request_checksum_calculation / "
            "response_checksum_validation in the AWS config file, or S3Volume(checksums=False); see "
            "docs/operating.md#s3-compatible-stores)"
        )
    return ""


def _error_info(exc: BaseException) -> tuple[int | None, str]:
    """HTTP status and S3 error code of a botocore ``ClientError`` (``(None, "")`` otherwise)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = str(response.get("Error", {}).get("Code", ""))
    return status, code


def _is_missing(exc: BaseException) -> bool:
    """Whether the object does not exist (a missing bucket is another matter: not a 404 of a key)."""
    status, code = _error_info(exc)
    return code != "NoSuchBucket" and (status == 404 or code in ("NoSuchKey", "404", "NotFound"))
