"""A Hugging Face ``datasets`` dataset saved with ``save_to_disk``: its ``data-*.arrow`` files are the
shards, a sample is one row (a dict of column to value, as ``pyarrow``'s ``to_pylist`` gives it: the
stored values, before ``datasets``' feature decoding such as images).

The files are Arrow IPC *streams* (no footer), so there is no table of contents to read; the index is
built once per file content by walking the stream's messages: for each message only its 8-byte
prefix and its flatbuffer metadata (a few hundred bytes: type, body length, record batch length) are
read and the body is skipped, so counting rows reads almost nothing of a remote file. The index
(each record batch's offset, size and row count) is cached like JSON Lines' (beside a writable local
file, else under the staging root, checked against the version stamp). The shard order is that of
``state.json``'s ``_data_files`` where it exists, else the files' names.

Damage: the stream must be whole messages, optionally ended by the end-of-stream marker and nothing
after it; bytes that are neither (a file cut inside a message or inside the marker, which pyarrow's
stream reader and ``datasets.load_from_disk`` refuse) are a
:class:`~uc_checkpoint.errors.DataFormatError` naming the file. A stream cut exactly between two
messages is, to the format and to pyarrow, a whole shorter stream (its writer may end it by closing).

Seeking: row ``i`` is in record batch ``b`` found by its cumulative row counts; that batch alone is
read (a slice of a memory map locally, one ranged read remotely) and decoded with pyarrow; the last
few batches stay cached in the process. Random access.

Message framing and metadata: the Arrow columnar format's IPC specification
(https://arrow.apache.org/docs/format/Columnar.html#serialization-and-interprocess-communication-ipc)
and its ``Message.fbs``; flatbuffer tables as in the FlatBuffers internals documentation.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from uc_checkpoint.data.readers.base import ShardReader, ShardReaderOptions, picks_of_groups, require, rows_of_groups
from uc_checkpoint.volumes import Volume

if TYPE_CHECKING:
    from typing_extensions import Unpack

_CONTINUATION = 0xFFFFFFFF
_FILE_MAGIC = b"ARROW1"  # the IPC file format (random access, with a footer), not a stream
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3  # Message.fbs: union MessageHeader


def _table_field(buf: bytes, table: int, field: int) -> int | None:
    """Absolute position of field ``field`` of the flatbuffer table at ``table``, None if absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vt_size = struct.unpack_from("<H", buf, vtable)[0]
    if 4 + 2 * field >= vt_size:
        return None
    offset = struct.unpack_from("<H", buf, vtable + 4 + 2 * field)[0]
    return None if offset == 0 else table + offset


def parse_message(meta: bytes) -> tuple[int, int, int]:
    """``(header type, body length in bytes, record batch rows or 0)`` of an Arrow IPC ``Message``
    flatbuffer (Message: version 0, header_type 1, header 2, bodyLength 3; RecordBatch: length 0).

    Raises:
        ValueError / struct.error: not a flatbuffer of that shape.
    """
    root = struct.unpack_from("<I", meta, 0)[0]
    kind_at = _table_field(meta, root, 1)
    kind = meta[kind_at] if kind_at is not None else 0
    body_at = _table_field(meta, root, 3)
    body = struct.unpack_from("<q", meta, body_at)[0] if body_at is not None else 0
    rows = 0
    if kind == _RECORD_BATCH:
        header_at = _table_field(meta, root, 2)
        if header_at is None:
            raise ValueError("record batch message without a header")
        batch = header_at + struct.unpack_from("<I", meta, header_at)[0]
        length_at = _table_field(meta, batch, 0)
        rows = struct.unpack_from("<q", meta, length_at)[0] if length_at is not None else 0
    if body < 0 or rows < 0:
        raise ValueError("negative body length or row count")
    return kind, body, rows


def _messages_fit(index: np.ndarray, size: int) -> bool:
    """Whether a message index (see :meth:`HfDatasetReader._index`) can be that of a stream of
    ``size`` bytes: the messages follow each other from byte 0, inside the file, with row counts
    that never decrease, and it ends with ``(size, 0, total rows)``."""
    offsets, lengths, before = index[:, 0], index[:, 1], index[:, 2]
    ends = offsets[:-1] + lengths[:-1]
    return bool(
        offsets[0] == 0
        and before[0] == 0
        and offsets[-1] == size
        and lengths[-1] == 0
        and (lengths[:-1] > 0).all()
        and (offsets[1:-1] == ends[:-1]).all()
        and ends[-1] <= size
        and (np.diff(before) >= 0).all()
    )


class HfDatasetReader(ShardReader):
    """Rows of a ``datasets.Dataset.save_to_disk`` directory (see the module docs).

    Args:
        location: the directory ``save_to_disk`` wrote (of one ``Dataset``, or one split of a
            ``DatasetDict``: ``<dir>/train``).
        columns: the columns to read (default: all).
        files, volume_options, index_dir: see :class:`~uc_checkpoint.data.readers.base.ShardReader`.
        cached_batches: decoded record batches kept per process.

    Needs pyarrow (``pip install 'uc-checkpoint[hf]'``); ``datasets`` itself is not imported.

    Raises:
        ImportError: pyarrow is missing (one line naming the extra).
        DataFormatError: a file is not an Arrow IPC stream (bad framing, cut inside a message, bytes
            after its end-of-stream marker, an IPC file), has dictionary batches, a batch that does
            not decode, or lacks a column; the message names the file.
    """

    suffixes = (".arrow",)
    random_access = True
    _kind = "arrow-stream-batches-v2"

    def __init__(
        self,
        location: str | os.PathLike[str] | Volume,
        *,
        columns: Sequence[str] | None = None,
        cached_batches: int = 2,
        **options: Unpack[ShardReaderOptions],
    ) -> None:
        require("pyarrow", "hf")
        super().__init__(location, **options)
        self.columns = None if columns is None else list(columns)
        self.cached_batches = max(1, cached_batches)

    def shard_files(self) -> list[str]:
        """``state.json``'s ``_data_files`` in order where it lists them, else the ``.arrow`` files."""
        if self.files is None:
            splits = self.volume.read_bytes("dataset_dict.json")
            if splits is not None:
                try:
                    names = ", ".join(str(n) for n in json.loads(splits).get("splits", []))
                except (ValueError, TypeError, AttributeError):
                    names = "see its dataset_dict.json"
                raise self.malformed(
                    "dataset_dict.json",
                    f"a DatasetDict saved with save_to_disk (splits: {names}); read one split: "
                    f"HfDatasetReader('{self.volume.url}/<split>')",
                )
            raw = self.volume.read_bytes("state.json")
            if raw is not None:
                try:
                    listed = [d["filename"] for d in json.loads(raw).get("_data_files", [])]
                except (ValueError, TypeError, KeyError, AttributeError):
                    raise self.malformed("state.json", "not the state.json save_to_disk writes") from None
                if listed:
                    return listed
        return super().shard_files()

    def _count(self, name: str, size: int, version: str) -> int:
        return int(self._index(name, size, version)[-1, 2])

    def _index(self, name: str, size: int | None = None, version: str | None = None) -> np.ndarray:
        """``(messages, 3)`` int64: row 0 is the schema message ``(offset, length, 0)``, then one row
        per record batch ``(offset, length, rows before it)``, then ``(size, 0, total rows)``."""
        return self.cached_table(name, self._kind, "<i8", 3, self._scan, size, version, min_rows=2, fits=_messages_fit)

    def _scan(self, name: str, size: int) -> np.ndarray:
        rows: list[tuple[int, int, int]] = []
        total = 0
        pos = 0
        while pos < size:
            head = self.read_bytes(name, pos, min(size, pos + 4096))
            if pos == 0 and head.startswith(_FILE_MAGIC):
                raise self.malformed(
                    name, "an Arrow IPC file (ARROW1 magic); save_to_disk writes, and this reader reads, IPC streams"
                )
            first = struct.unpack_from("<I", head, 0)[0] if len(head) >= 4 else None
            prefix = 8 if first == _CONTINUATION else 4  # streams before Arrow 0.15 have no continuation
            if len(head) < prefix:
                raise self.malformed(
                    name,
                    f"truncated: {size - pos} bytes at byte {pos} are neither a whole Arrow message nor the "
                    "end-of-stream marker",
                )
            meta_len = struct.unpack_from("<i", head, prefix - 4)[0]
            if meta_len == 0:  # the end-of-stream marker: nothing may follow it
                if pos + prefix < size:
                    raise self.malformed(
                        name,
                        f"{size - pos - prefix} bytes follow its end-of-stream marker at byte {pos} "
                        "(damaged, or streams written one after another?)",
                    )
                break
            if meta_len < 0 or pos + prefix + meta_len > size:
                raise self.malformed(name, f"not an Arrow IPC stream, or truncated (message at byte {pos})")
            meta = head[prefix : prefix + meta_len]
            if len(meta) < meta_len:
                meta = self.read_bytes(name, pos + prefix, pos + prefix + meta_len)
            try:
                kind, body, batch_rows = parse_message(meta)
            except (ValueError, struct.error, IndexError) as exc:
                raise self.malformed(name, f"bad Arrow message at byte {pos}: {exc}") from None
            length = prefix + meta_len + body
            if pos + length > size:
                raise self.malformed(name, f"truncated: the message at byte {pos} ends past its {size} bytes")
            if kind == _SCHEMA and not rows:
                rows.append((pos, length, 0))
            elif kind == _RECORD_BATCH and rows:
                rows.append((pos, length, total))
                total += batch_rows
            elif kind == _DICTIONARY_BATCH:
                raise self.malformed(name, "has dictionary batches, which this reader does not decode")
            else:
                raise self.malformed(name, f"unexpected Arrow message type {kind} at byte {pos}")
            pos += length
        if not rows:
            raise self.malformed(name, "not an Arrow IPC stream (no schema message)")
        rows.append((size, 0, total))
        return np.asarray(rows, dtype=np.int64)

    def _message(self, name: str, offset: int, length: int) -> Any:
        pa = require("pyarrow", "hf")
        path = self.local_path(name)
        if path is not None:
            key = ("mmap", name)
            mapped = self.cache.get(key)
            if mapped is None:  # the whole file as one zero-copy buffer over a memory map
                mapped = self.cache[key] = pa.memory_map(str(path), "r").read_buffer()
            if offset + length > mapped.size:
                raise self.malformed(name, "is shorter than its index (truncated since it was indexed?)")
            return mapped.slice(offset, length)
        return pa.py_buffer(self.read_bytes(name, offset, offset + length))

    def _schema(self, name: str) -> Any:
        key = ("schema", name)
        found = self.cache.get(key)
        if found is None:
            pa = require("pyarrow", "hf")
            index = self._index(name)
            try:
                found = pa.ipc.read_schema(self._message(name, int(index[0, 0]), int(index[0, 1])))
            except pa.ArrowException as exc:
                raise self.malformed(name, f"bad Arrow schema: {exc}") from None
            missing = [c for c in self.columns or () if c not in found.names]
            if missing:
                raise self.malformed(name, f"has no column(s) {missing}; it has {found.names}")
            self.cache[key] = found
        return found

    def _batch(self, name: str, b: int) -> list[dict[str, Any]]:
        """The rows of record batch ``b`` (0-based), decoded (the last few kept: ``cached_batches``)."""
        return self.recent("batches", (name, b), self.cached_batches, lambda: self._decode_batch(name, b))

    def _decode_batch(self, name: str, b: int) -> list[dict[str, Any]]:
        pa = require("pyarrow", "hf")
        index = self._index(name)
        schema = self._schema(name)
        try:
            message = pa.ipc.read_message(self._message(name, int(index[b + 1, 0]), int(index[b + 1, 1])))
            batch = pa.ipc.read_record_batch(message, schema)
            if self.columns is not None:
                batch = batch.select(self.columns)
            rows: list[dict[str, Any]] = batch.to_pylist()
        except (pa.ArrowException, UnicodeDecodeError) as exc:  # UnicodeDecodeError: a damaged string column
            raise self.malformed(name, f"cannot decode record batch {b}: {exc}") from None
        expected = int(index[b + 2, 2] - index[b + 1, 2])
        if len(rows) != expected:
            raise self.malformed(
                name, f"record batch {b} decoded to {len(rows)} rows, its message header says {expected}"
            )
        return rows

    def _read_range(self, name: str, start: int, end: int) -> Iterator[dict[str, Any]]:
        firsts = self._index(name)[1:, 2].tolist()  # rows before each batch, then the total
        if end > firsts[-1]:
            raise self.malformed(name, f"has {firsts[-1]} rows, {end} asked")
        yield from rows_of_groups(firsts, lambda b: self._batch(name, b), start, end)

    def _read_indices(self, name: str, indices: np.ndarray) -> Iterator[dict[str, Any]]:
        firsts = self._index(name)[1:, 2].tolist()
        yield from picks_of_groups(firsts, lambda b: self._batch(name, b), indices)


__all__ = ["HfDatasetReader", "parse_message"]
