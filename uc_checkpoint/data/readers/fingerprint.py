"""What identifies a shard file: its content fingerprint, the same wherever the bytes are stored
(:func:`content_fingerprint`, the :attr:`~uc_checkpoint.data.intervals.ShardSpec.fingerprint` the readers give), and the store's
version stamp of the file in one place (:func:`version_of`: mtime or ETag), which keys what is kept
per place and shows that a file was rewritten. Trade-offs and costs: ``docs/data-tracker.md``,
"Fingerprints".
"""

from __future__ import annotations

import hashlib

from uc_checkpoint.errors import CorruptCheckpointError, DataFormatError
from uc_checkpoint.volumes import FileStat, Volume

#: Bytes at each end of a file that :func:`content_fingerprint` hashes.
FINGERPRINT_BLOCK = 64 << 10
_FINGERPRINT_TAG = b"uc_checkpoint.data.shard_content.v1\n"


def version_of(stat: FileStat) -> str:
    """The store's version stamp of a file, which changes whenever the file is rewritten in place:
    ``etag=<ETag>,size=<bytes>`` where the store keeps version tags (objects),
    ``size=<bytes>,mtime_ns=<int>`` where it keeps times (local files), else ``size=<bytes>``. It
    depends on the place (a copy has another mtime or ETag), so it keys what is kept per place (the
    :class:`~uc_checkpoint.data.readers.base.IndexCache`) and the check that a file did not change
    since :meth:`~uc_checkpoint.data.readers.base.ShardReader.shards`; what identifies a shard
    wherever it is stored is :func:`content_fingerprint`."""
    if stat.etag:
        return f"etag={stat.etag},size={stat.size}"
    if stat.mtime_ns is not None:
        return f"size={stat.size},mtime_ns={stat.mtime_ns}"
    return f"size={stat.size}"


def content_fingerprint(volume: Volume, name: str, size: int) -> str:
    """The content fingerprint of the file ``name`` of ``volume``, of ``size`` bytes (the contract
    of :attr:`~uc_checkpoint.data.intervals.ShardSpec.fingerprint`):
    ``size=<bytes>,ends_sha256=<32 hex digits>``, the first 128 bits of sha256 over the size and the
    file's first and last :data:`FINGERPRINT_BLOCK` bytes (the whole file when it is at most twice
    that). It depends on the bytes only, not on where they are
    stored or when they were written, so the same files copied to another directory or synced to an
    object store keep it.

    What it sees: any change of size; any change in the first and last 64 KiB (where the formats keep
    their headers, footers and indexes: a Parquet footer's row-group offsets and statistics, a
    ``.npy`` header, an Arrow stream's schema and end, a tar's end, a JSON Lines file's first and
    last lines); any change at all of a file up to 128 KiB. What it does not see: a rewrite of a
    larger file that keeps its size and its first and last 64 KiB (a same-length edit in the middle).
    Cost: two ranged reads of 64 KiB (one for a small file), whatever the file's size; a full
    content hash would read every byte of every shard at every job start.

    Raises:
        DataFormatError: the file is missing or shorter than ``size``.
        TransferError: the store failed otherwise.
    """
    h = hashlib.sha256(_FINGERPRINT_TAG + f"{size}\n".encode())
    try:
        if size <= 2 * FINGERPRINT_BLOCK:
            h.update(volume.read_range(name, 0, size) if size else b"")
        else:
            h.update(volume.read_range(name, 0, FINGERPRINT_BLOCK))
            h.update(volume.read_range(name, size - FINGERPRINT_BLOCK, size))
    except CorruptCheckpointError as exc:
        raise DataFormatError(
            f"data shard {volume.url_of(name)}: cannot read it to fingerprint its content: the file is missing "
            f"or shorter than {size} bytes (changed while being read?)"
        ) from exc
    return f"size={size},ends_sha256={h.hexdigest()[:32]}"


def file_fingerprint(name: str, volume: Volume) -> str:
    """The :func:`content_fingerprint` of the file ``name`` of ``volume``: one ``stat`` (a HEAD on
    S3) and one or two ranged reads.

    Raises:
        DataFormatError: the file does not exist.
        VolumeError / TransferError: the store could not be asked.
    """
    stat = volume.stat(name)
    if stat is None:
        raise DataFormatError(f"data shard {volume.url_of(name)} does not exist")
    return content_fingerprint(volume, name, stat.size)


__all__ = ["FINGERPRINT_BLOCK", "content_fingerprint", "file_fingerprint", "version_of"]
