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

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

from uc_checkpoint.errors import CheckpointExistsError, CorruptCheckpointError, TransferError, VolumeError
from uc_checkpoint.format.integrity import Digest, FileRecord, composite_crc32_base64, crc32, crc32_base64, digest_file
from uc_checkpoint.format.layout import is_checkpoint_file
from uc_checkpoint.volumes.base import Entry, FileStat, Volume
from uc_checkpoint.volumes.locations import canonical_key_path, check_bucket_name
from uc_checkpoint.volumes.process_local import ProcessLocal
from uc_checkpoint.volumes.retry import retry
from uc_checkpoint.volumes.s3_client import ClientSettings, SharedClient, read_body_into
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
            second read of each staged file for it: the ``uc-s3-unsigned`` rows of
            docs/benchmarks.md show its cost on a plain-HTTP store). botocore signs bodies only over
            plain ``http://`` (over ``https`` the CRC-32 and TLS stand in for it); None (default)
            keeps that. False skips it on a plain-HTTP endpoint too (the body's CRC-32 is still sent
            and checked by the store), as s3torchconnector's CRT client always does: for a store
            inside the cluster where nobody can alter traffic in flight. True signs always.

    The client itself (how it is built, cached, shared and hooked) is
    :mod:`uc_checkpoint.volumes.s3_client`'s.

    Raises:
        VolumeError: ``url`` is not ``s3://bucket/...``.
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
        self._shared = SharedClient(client)
        # This volume object's s3transfer manager, in each process: a forked child inherits the
        # parent's manager but not its worker threads (a transfer submitted there would wait forever).
        self._transfers: ProcessLocal[Any] = ProcessLocal()

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
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        retries = state.pop("_shared")
        self.__dict__.update(state)
        self._shared = SharedClient(retries=retries)

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
        return self._shared.take(self.client_factory, self._client_settings())

    def _client_settings(self) -> ClientSettings:
        """What this volume's client is built from (the cache key, with the environment)."""
        return ClientSettings(
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
        """This process's s3transfer ``TransferManager`` of this volume object, made on first use.
        It runs on our threads, not ThreadPoolExecutor's: a save running while the interpreter
        exits goes on uploading (see :mod:`uc_checkpoint.volumes.workers`)."""
        return self._transfers.get(self._new_transfer_manager)

    def _new_transfer_manager(self) -> Any:
        from s3transfer.manager import TransferManager

        return TransferManager(self.client, self.transfer_config, executor_cls=Workers)

    def close(self) -> None:
        """Shut this process's transfer manager down (a later transfer makes another)."""
        manager = self._transfers.take()
        if manager is not None:
            manager.shutdown()

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
        return self._list_objects("", delimiter=True)

    def list_tree(self, prefix: str = "") -> list[Entry]:
        """One ``ListObjectsV2`` without delimiter under ``<location>/<prefix>``, every page (1,000
        keys each): every object below, at any depth, with its size and ``LastModified``. S3 has no
        sub-locations to report (a zero-byte "folder" object ``a/`` is listed as one)."""
        return self._list_objects(prefix, delimiter=False)

    def _list_objects(self, below: str, *, delimiter: bool) -> list[Entry]:
        """The objects whose keys start with this location's prefix and ``below``, named relative to
        the location; with ``delimiter``, only those directly at it and its common prefixes.

        Raises:
            VolumeError: the bucket is missing or access to it denied.
            TransferError: a page failed otherwise.
        """
        prefix = self._dir_prefix()
        out: list[Entry] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix + below, **({"Delimiter": "/"} if delimiter else {})
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix) :]
                    if name.endswith("/"):
                        out.append(Entry(name, -1))  # a "folder" object: a sub-location, as a delimited listing says
                    elif name:
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

    def stat(self, name: str) -> FileStat | None:
        """One HeadObject: ``ContentLength``, ``LastModified`` and the ETag (quotes stripped)."""
        head = self._head(name)
        if head is None:
            return None
        modified = head.get("LastModified")
        mtime_ns = int(modified.timestamp() * 1_000_000_000) if modified is not None else None
        etag = head.get("ETag")
        return FileStat(int(head["ContentLength"]), mtime_ns, etag.strip('"') if etag else None)

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
        (:class:`~uc_checkpoint.volumes.s3_client.PartChecksums`); a no-op without ``checksum`` or where botocore sends its own CRC-32
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
            got = self._get_range(name, start, end, lambda body: read_body_into(body, views), file_size)
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
        retried here (:func:`~uc_checkpoint.volumes.retry.retry`), with the same backoff shape. With ``file_size``, a ranged response whose
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

        def attempt() -> _R:
            response = self.client.get_object(**kwargs)
            if file_size is not None:
                self._check_object_size(name, response, file_size)
            return receive(response["Body"]) if receive is not None else response["Body"].read()

        def count(attempt: int, delay: float, exc: BaseException) -> None:
            logger.debug("GET %s cut off (%s); retry %d in %.2f s", self.url_of(name), exc, attempt, delay)
            self._shared.add_retries(1)

        # Full jitter over 0.2 s, 0.4 s, ... up to 20 s; the last attempt's error is raised as it is.
        return retry(
            attempt,
            attempts=self.max_attempts,
            retry_on=cut_off,
            backoff_s=0.2,
            max_backoff_s=20.0,
            jitter=True,
            on_retry=count,
        )

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
        self,
        older_than_s: float | None = None,
        keep: Callable[[str], bool] | None = None,
        within: Callable[[str], bool] | None = None,
    ) -> int:
        prefix = self._dir_prefix()
        covered = _at_location if within is None else within
        aborted = 0
        cutoff = None if older_than_s is None else time.time() - older_than_s
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for upload in page.get("Uploads", []):
                    name = upload["Key"][len(prefix) :]
                    if not covered(name) or (keep is not None and keep(name)):
                        continue  # not a file of the locations covered, or the caller keeps it
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


def _at_location(name: str) -> bool:
    """Whether the key ``name`` (relative to a location) is a file of that location: directly in
    it, or a data file in one of its spread prefixes (:func:`uc_checkpoint.format.layout.spread_dir`),
    not something of a location below it."""
    return "/" not in name or is_checkpoint_file(name)


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
