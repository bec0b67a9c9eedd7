"""DCP's stream extensions on our writer and reader, and what the other arguments of DCP's
``FileSystemWriter``/``FileSystemReader`` mean on ours.

Stream extensions (``torch.distributed.checkpoint._extension``, experimental in torch 2.13) transform
each item's bytes on the way to storage and back: ``ZStandard`` compression, or a user's
``StreamTransformExtension`` (encryption, say). The on-volume format is DCP's own, so either side
reads the other's checkpoints: each item is written through the chain of ``transform_to`` streams
DCP's ``_StorageWriterTransforms`` builds, and its ``_StorageInfo`` records what was stored (offset
and length of the transformed bytes in the data file) and the extensions' descriptors
(``transform_descriptors``, e.g. ``["stream.zstd/1"]``); a reader rebuilds the extensions from the
descriptors through an ``ExtensionRegistry`` (DCP's default one knows ``ZStandard`` only) and reads
the item through their ``transform_from`` streams. One extension per writer: DCP undoes a chain of
two or more in the wrong order, so not even its own reader loads such a checkpoint (torch 2.13).

What follows from it here:

- the manifest's CRC-32s (of files and 4 MiB blocks) are of the staged files, i.e. of the bytes on
  the volume, after compression: a load verifies what it fetched before undoing any transform;
- a transformed item is always fetched and untransformed whole (its stored bytes are not the tensor's
  bytes), then decoded as a plain one: a resharded read narrows the decoded tensor, and no item's
  bytes are received straight into a target tensor (:meth:`~uc_checkpoint.dcp.items.ItemLoader.place`);
- items are still encoded by :class:`~uc_checkpoint.dcp.item_codec.ItemCodec` (the same
  ``torch.save`` archives), only written through the transform chain; without extensions nothing
  here runs and the writer's path is unchanged.

ZStandard needs the ``zstandard`` or ``pyzstd`` package (``pip install uc-checkpoint[zstd]``);
DCP's ``ZStandard()`` raises ``ValueError`` when neither is installed.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import IO, TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import WriteResult

from uc_checkpoint.dcp.buffers import StagingBuffers
from uc_checkpoint.dcp.compat import (
    HAS_STREAM_EXTENSIONS,
    ExtensionRegistry,
    StreamTransformExtension,
    _StorageInfo,
)
from uc_checkpoint.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from uc_checkpoint.dcp.item_codec import ItemCodec


#: The one value of ``FileSystemWriter``'s ``serialization_format`` our writer takes (by name, as
#: the enum is missing from older torch): DCP's ``torch.save`` per item archives.
TORCH_SAVE_FORMAT = "TORCH_SAVE"


def check_extensions(extensions: object) -> list[Any] | None:
    """``FileSystemWriter``'s ``_extensions`` as a list (None for None: no transform).

    Raises:
        TypeError: not a sequence of ``StreamTransformExtension`` instances.
        ValueError: more than one extension (DCP cannot read such a chain back), or this torch has
            no stream extensions (before 2.7).
    """
    if extensions is None:
        return None
    if not HAS_STREAM_EXTENSIONS:
        raise ValueError("_extensions needs torch 2.7 or later (DCP's stream extensions)")
    if isinstance(extensions, (str, bytes)) or not isinstance(extensions, Sequence):
        raise TypeError(f"_extensions must be a sequence of StreamTransformExtension, got {type(extensions).__name__}")
    for ex in extensions:
        if not isinstance(ex, StreamTransformExtension):
            raise TypeError(f"_extensions must hold StreamTransformExtension instances, got {type(ex).__name__}")
    if len(extensions) > 1:
        # DCP records a chain's descriptors innermost first and its reader wraps the stored bytes in
        # that order, so it undoes the innermost transform first: FileSystemReader cannot load
        # FileSystemWriter's own checkpoints of two or more extensions (torch 2.13).
        raise ValueError(
            f"_extensions holds {len(extensions)} extensions: DCP's readers (stock and ours) read back one per "
            "item only (they undo a chain in the wrong order); combine them into one StreamTransformExtension"
        )
    return list(extensions)


def check_registry(registry: object) -> Any | None:
    """``FileSystemReader``'s ``_extension_registry`` (None: DCP's default registry).

    Raises:
        TypeError: not an ``ExtensionRegistry``.
        ValueError: this torch has no stream extensions (before 2.7).
    """
    if registry is None:
        return None
    if not HAS_STREAM_EXTENSIONS:
        raise ValueError("_extension_registry needs torch 2.7 or later (DCP's stream extensions)")
    if not isinstance(registry, ExtensionRegistry):
        raise TypeError(f"_extension_registry must be an ExtensionRegistry, got {type(registry).__name__}")
    return registry


def stock_writer_arguments(
    extensions: object, cache_staged_state_dict: object, serialization_format: object, *, staging_buffers: object
) -> tuple[StagingBuffers | None, dict[str, Any]]:
    """Check the arguments ``UCVolumeWriter`` takes from DCP's ``FileSystemWriter`` that are not
    :class:`~uc_checkpoint.dcp.options.WriterOptions` fields (and its own ``staging_buffers``);
    return the writer's staging buffers and the keyword arguments for
    ``FileSystemWriter.__init__`` (``_extensions``, when given).

    ``cache_staged_state_dict=True`` gives the writer staging buffers of its own: DCP's cache of
    the staged state dict between async saves of one writer is what
    :class:`~uc_checkpoint.dcp.buffers.StagingBuffers` keeps.

    Raises:
        TypeError: a wrong type.
        ValueError: ``cache_staged_state_dict`` with ``staging_buffers`` (both keep the snapshot),
            or a ``serialization_format`` other than ``TORCH_SAVE``.
    """
    if staging_buffers is not None and not isinstance(staging_buffers, StagingBuffers):
        raise TypeError(f"staging_buffers must be a StagingBuffers or None, got {type(staging_buffers).__name__}")
    if not isinstance(cache_staged_state_dict, bool):
        raise TypeError(f"cache_staged_state_dict must be a bool, got {type(cache_staged_state_dict).__name__}")
    name = getattr(serialization_format, "name", serialization_format)
    if serialization_format is not None and name != TORCH_SAVE_FORMAT:
        raise ValueError(
            f"serialization_format={serialization_format!r} is not supported: UCVolumeWriter writes DCP's "
            "torch.save format (SerializationFormat.TORCH_SAVE) only and has no safetensors equivalent "
            "(DCP's HuggingFaceStorageWriter writes that)"
        )
    if cache_staged_state_dict:
        if staging_buffers is not None:
            raise ValueError("pass cache_staged_state_dict=True or staging_buffers, not both: both keep the snapshot")
        staging_buffers = StagingBuffers()
    base: dict[str, Any] = {}
    checked = check_extensions(extensions)
    if checked is not None:  # passed only when given: DCP before 2.7 has no such argument
        base["_extensions"] = checked
    return staging_buffers, base


def active(transforms: Any) -> Any | None:
    """The writer's ``transforms`` (DCP's ``_StorageWriterTransforms``) when it has extensions, else
    None: the plain path."""
    return transforms if getattr(transforms, "extensions", None) else None


def write_item(
    transforms: Any, stream: IO[bytes], item: Any, storage_key: str, data: Any, codec: ItemCodec
) -> WriteResult:
    """Write one item through the extensions' ``transform_to`` chain, as DCP's ``_write_item``: a
    byte item's ``data`` (a buffer) as it is, a tensor (on the CPU) as ``codec`` encodes it. What
    lands in ``stream`` is the transformed bytes; the result records their offset and length in
    the file (bytes) and the extensions' descriptors in DCP's order."""
    offset = stream.tell()
    out, descriptors = transforms.transform_save_stream(item, stream)
    if isinstance(data, torch.Tensor):
        codec.write(data, out)
    else:
        out.write(data)
    out.close()  # ends the chain (a compressor's last frame); DCP's wrapper leaves ``stream`` open
    length = stream.tell() - offset
    info = _StorageInfo(storage_key, offset, length, transform_descriptors=list(descriptors) or None)
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=info)


def _hint(descriptors: Sequence[str]) -> str:
    return (
        f"items written with DCP stream extensions {list(descriptors)} need each of them in the reader's "
        "registry: UCVolumeReader(path, _extension_registry=registry) with registry.register(TheExtension) "
        "(DCP's default registry knows stream.zstd, which needs the zstandard package: uc-checkpoint[zstd])"
    )


def check_readable(transforms: Any, descriptor_lists: Iterable[Sequence[str] | None], where: str) -> None:
    """Check, before anything is fetched, that the reader's registry can rebuild every extension
    that ``descriptor_lists`` (the ``transform_descriptors`` of a load plan's items) name.

    Raises:
        ValueError: naming ``where``, the descriptors, DCP's reason and how to register them.
    """
    for descriptors in {tuple(d) for d in descriptor_lists if d}:
        try:
            transforms.extension_registry.from_descriptor_list(descriptors)
        except Exception as exc:  # DCP raises ValueError; an extension's from_descriptor anything
            raise ValueError(f"{where}: {exc}; {_hint(descriptors)}") from exc


def untransform(transforms: Any, req: ReadItem, descriptors: Sequence[str], data: memoryview, where: str) -> memoryview:
    """An item's plain bytes from its stored (transformed) ``data``, read whole through the
    extensions' ``transform_from`` chain (DCP's ``_StorageReaderTransforms``).

    Raises:
        ValueError: the registry cannot rebuild an extension (see :func:`check_readable`).
        CorruptCheckpointError: the stored bytes do not untransform (damaged, or not what the
            extension wrote); the message names ``where``.
    """
    try:
        stream = transforms.transform_load_stream(req, descriptors, io.BytesIO(data))
    except Exception as exc:
        raise ValueError(f"{where}: {exc}; {_hint(descriptors)}") from exc
    try:
        return memoryview(stream.read(-1))
    except Exception as exc:  # a decompressor's or user transform's error on damaged bytes
        raise CorruptCheckpointError(
            f"{where}: its stored bytes do not undo through {list(descriptors)}: {type(exc).__name__}: {exc}"
        ) from exc


__all__ = [
    "TORCH_SAVE_FORMAT",
    "active",
    "check_extensions",
    "check_readable",
    "check_registry",
    "stock_writer_arguments",
    "untransform",
    "write_item",
]
