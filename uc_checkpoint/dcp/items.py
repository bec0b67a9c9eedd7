"""Decoding the items of a DCP load plan from their bytes into the planner's tensors and objects.

Items are deserialised as DCP's ``FileSystemReader.read_data`` does (``torch.load`` of each tensor
item, narrowed to the requested slice and copied into the load plan's tensor; ``planner.load_bytes``
for byte items), except that small tensor items written by our writer (or by ``torch.save`` of a
plain tensor) are decoded by :class:`~uc_checkpoint.dcp.item_codec.ItemCodec`. Every failure to decode
is a :class:`~uc_checkpoint.errors.CorruptCheckpointError` naming the file, the item and its offset.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from uc_checkpoint.dcp import extensions
from uc_checkpoint.dcp.compat import _StorageInfo, narrow_tensor_by_index
from uc_checkpoint.dcp.item_codec import ItemCodec
from uc_checkpoint.errors import CorruptCheckpointError, ItemChecksumError, UCCheckpointError
from uc_checkpoint.volumes import Volume
from uc_checkpoint.volumes.ranged import RangedStream

#: (fqn, chunk offsets) -> (dtype, chunk shape): what each tensor item of a checkpoint holds.
ChunkShapes = dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]


def chunk_shapes(metadata: Metadata) -> ChunkShapes:
    """What each tensor chunk in ``metadata`` holds, for :class:`~uc_checkpoint.dcp.item_codec.ItemCodec`."""
    return {
        (fqn, tuple(chunk.offsets)): (md.properties.dtype, tuple(chunk.sizes))
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
        for chunk in md.chunks
    }


class ItemLoader:
    """Decodes one load's items and hands each to its planner.

    Args:
        volume: the checkpoint's volume (for messages).
        planner: the load's planner (``load_bytes``, ``resolve_tensor``, ``commit_tensor``).
        storage_data: where each item lies (DCP's ``_StorageInfo`` per storage index).
        chunks: :func:`chunk_shapes` of the checkpoint's metadata.
        transforms: ``FileSystemReader.transforms``, for items written with DCP extensions (e.g.
            compression); unused otherwise.
        check_archive_crc: check each tensor item's zip CRC-32s when it is not decoded by the codec
            (checkpoints without a manifest: nothing else covers their bytes, and ``torch.load``
            does not check them).
        codec: the fast decoder (its ``fast_decoded`` counts the items it decoded).
    """

    def __init__(
        self,
        volume: Volume,
        planner: LoadPlanner,
        storage_data: Mapping[Any, _StorageInfo],
        chunks: ChunkShapes,
        *,
        transforms: Any,
        check_archive_crc: bool,
        codec: ItemCodec | None = None,
    ) -> None:
        self.volume = volume
        self.planner = planner
        self.storage_data = storage_data
        self.chunks = chunks
        self.transforms = transforms
        self.check_archive_crc = check_archive_crc
        self.codec = codec if codec is not None else ItemCodec()
        # Items whose tensor bytes a ranged read receives straight into their target (see place),
        # and the targets place resolved for the others (each item's target is resolved once).
        self._placed: dict[int, _Placed] = {}
        self._resolved: dict[int, torch.Tensor] = {}

    def by_file(self, items: Iterable[ReadItem]) -> dict[str, list[ReadItem]]:
        """``items`` grouped by their data file's name, files in order of first use."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        return per_file

    def spans(self, items: Iterable[ReadItem]) -> list[tuple[str, int, int, ReadItem]]:
        """``(file name, offset, length, item)`` of each of ``items``, for
        :func:`~uc_checkpoint.engine.ranges.plan_ranges`."""
        out = []
        for item in items:
            info = self.storage_data[item.storage_index]
            out.append((info.relative_path, info.offset, info.length, item))
        return out

    def place(self, items: Iterable[ReadItem]) -> None:
        """Choose the items whose tensor bytes are received straight into their target tensors
        (skipping a buffer and a copy of every byte): whole saved chunks of plain CPU tensors above
        the codec's small-tensor size, stored without transforms, whose memory no other item's
        target shares (reads run in parallel and each block is verified where it landed: a shared
        target, e.g. two views of one buffer, would be written by another read meanwhile). Every
        tensor item's target is resolved here, once."""
        if self.check_archive_crc:
            return
        chosen: list[tuple[ReadItem, _Placed]] = []
        spans: list[tuple[int, int, int]] = []  # memory of every CPU target: (start, end, item id)
        for req in items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                continue
            target = self.planner.resolve_tensor(req).detach()
            self._resolved[id(req)] = target
            memory = _memory_span(target)
            if memory is not None:
                spans.append((*memory, id(req)))
            if info.transform_descriptors:
                continue
            saved = self.chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
            if saved is None or not _whole_chunk(req, saved[1]):
                continue
            span = self.codec.tensor_span(target)
            if target.dtype != saved[0] or tuple(target.shape) != saved[1] or span is None or span[1] > info.length:
                continue
            start, end, into = span
            chosen.append((req, _Placed(info.offset + start, info.offset + end, into, target)))
        shared = _overlapping(spans)
        for req, placed in chosen:
            if id(req) not in shared:
                del self._resolved[id(req)]
                self._placed[id(req)] = placed

    def received_in_place(self, items: Iterable[ReadItem]) -> list[tuple[int, int, memoryview]]:
        """``(lo, hi, into)`` for each of ``items`` chosen by :meth:`place`: file bytes ``[lo, hi)``
        go into ``into`` instead of the range's buffer. Sorted by ``lo``."""
        return sorted(
            ((p.lo, p.hi, p.into) for item in items if (p := self._placed.get(id(item))) is not None),
            key=lambda s: s[0],
        )

    def load_file(self, items: Iterable[ReadItem], path: Path) -> None:
        """Load ``items`` from the local copy ``path`` of their data file."""
        with open(path, "rb") as f:
            for item in items:
                info = self.storage_data[item.storage_index]
                f.seek(info.offset)
                self.load(item, memoryview(f.read(info.length)))

    def load_range(self, items: Iterable[ReadItem], start: int, data: memoryview) -> None:
        """Load ``items`` from ``data``, the bytes of their file from offset ``start`` on."""
        for item in items:
            info = self.storage_data[item.storage_index]
            lo = info.offset - start
            self.load(item, data[lo : lo + info.length])

    def load(self, req: ReadItem, data: memoryview) -> None:
        """Deserialise one item from its bytes and hand it to the planner.

        Raises:
            CorruptCheckpointError: the bytes are not the item, fail a checksum, or give a tensor of
                another shape than the plan expects; the message names the file and the item.
        """
        info = self.storage_data[req.storage_index]
        placed = self._placed.pop(id(req), None)
        if placed is not None:
            if self.codec.received_into(data, placed.target):
                self.planner.commit_tensor(req, placed.target)
                return
            # Not the archive layout expected: put its tensor bytes back in place and decode it whole.
            whole = bytearray(data)
            whole[placed.lo - info.offset : placed.hi - info.offset] = placed.into
            data = memoryview(whole)
            self._resolved[id(req)] = placed.target
        where = f"{self.volume.url_of(info.relative_path)}: item {req.storage_index.fqn} at offset {info.offset}"
        if info.transform_descriptors:  # written with DCP's stream extensions (e.g. compression)
            data = extensions.untransform(self.transforms, req, info.transform_descriptors, data, where)
        if req.type == LoadItemType.BYTE_IO:
            try:
                self.planner.load_bytes(req, io.BytesIO(data))
            except UCCheckpointError:
                raise
            except Exception as exc:  # torch.load of bytes that are not the item (damaged metadata or file)
                raise CorruptCheckpointError(f"{where} cannot be decoded: {type(exc).__name__}: {exc}") from exc
            return
        saved = self.chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        target = self._resolved.pop(id(req), None)
        if target is None:
            target = self.planner.resolve_tensor(req).detach()
        if saved is not None and not self.check_archive_crc and _whole_chunk(req, saved[1]):
            # The manifest's block checksums covered these bytes: copy them straight into place.
            if target.dtype == saved[0] and tuple(target.shape) == saved[1] and self.codec.decode_into(data, target):
                self.planner.commit_tensor(req, target)
                return
        try:
            tensor = self.codec.decode(data, *saved) if saved is not None else None
        except ItemChecksumError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}") from exc
        if tensor is None and self.check_archive_crc:
            bad = zip_crc_problem(data)
            if bad is not None:
                raise CorruptCheckpointError(f"{where} fails its archive's CRC-32 ({bad}): the file was damaged")
        try:
            if tensor is None:
                tensor = torch.load(cast(IO[bytes], MemoryReader(data)), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        except Exception as exc:  # not a tensor archive, or not the chunk the metadata describes
            raise CorruptCheckpointError(f"{where} cannot be decoded: {type(exc).__name__}: {exc}") from exc
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{self.volume.url_of(info.relative_path)}: item {req.storage_index.fqn} gives a tensor of shape "
                f"{tuple(tensor.size())}, the load plan expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        self.planner.commit_tensor(req, target)


@dataclass(frozen=True)
class _Placed:
    """An item whose tensor bytes (file offsets ``[lo, hi)``) are received into ``into``, the
    memory of ``target``."""

    lo: int
    hi: int
    into: memoryview
    target: torch.Tensor


def _memory_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[start, end)`` addresses of the memory a CPU tensor's elements lie in (None: not on the
    CPU, or no elements)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    low = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st < 0)
    high = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    base = t.data_ptr()
    return base + low * t.element_size(), base + (high + 1) * t.element_size()


def _overlapping(spans: list[tuple[int, int, int]]) -> set[int]:
    """The ids of the spans ``(start, end, id)`` that share memory with another one."""
    out: set[int] = set()
    reach, holder = -1, -1  # the furthest end so far, and whose
    for start, end, key in sorted(spans):
        if start < reach:
            out.update((key, holder))
        if end > reach:
            reach, holder = end, key
    return out


def _whole_chunk(req: ReadItem, shape: tuple[int, ...]) -> bool:
    """Whether ``req`` reads all of a saved chunk of ``shape`` (no resharding slice)."""
    return tuple(req.lengths) == shape and not any(req.storage_offsets)


def zip_crc_problem(data: memoryview) -> str | None:
    """The first member of the zip archive ``data`` whose CRC-32 is wrong (or why it is no zip),
    else None. Reads every member once, without copying ``data``."""
    try:
        with zipfile.ZipFile(cast(IO[bytes], MemoryReader(data))) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if bad is None else f"member {bad}"


class MemoryReader(RangedStream):
    """A read-only, seekable stream over a memoryview, without copying it (``io.BytesIO`` would)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__(lambda start, end: data[start:end], len(data))
