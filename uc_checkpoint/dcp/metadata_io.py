"""Decoding a checkpoint's ``.metadata`` without trusting it.

``.metadata`` is a pickle (DCP's format), and unpickling calls whatever functions the pickle names.
A checkpoint is data, often from a shared bucket or another team, so it is decoded with an
unpickler that resolves only the globals DCP's metadata is made of (:data:`ALLOWED_GLOBALS`, plus
torch dtypes by name, and ``getattr`` only as the by-name form of one of its enums' members). The decoded ``Metadata`` is then checked so that every data file it (or our
manifest, see :mod:`uc_checkpoint.format.layout`) names is a plain file inside the checkpoint location.

The torch-free parts (the checksum trailer, the allow-list, the file-name rules, the checks of
storage entries and of the manifest) are :mod:`uc_checkpoint.format.metadata_peek`'s, shared with
its torch-free reader of what a ``.metadata`` references (``uc-checkpoint ls``).
"""

from __future__ import annotations

import enum
import hashlib
import io
import logging
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from uc_checkpoint.dcp.compat import _StorageInfo
from uc_checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeMetadataError
from uc_checkpoint.format import layout
from uc_checkpoint.format import manifest as manifest_format
from uc_checkpoint.format.metadata_peek import (
    ALLOWED_GLOBALS,
    GETATTR_GLOBALS,
    TRAILER_PREFIX,
    check_manifest,
    check_storage_entry,
    check_trailer_kept,
    checked_payload,
    enum_member_error,
    storage_mapping,
    unsafe_global,
)
from uc_checkpoint.format.metadata_peek import (
    bad_file_name as bad_file_name,  # re-exported: readers and tests name it here
)

if TYPE_CHECKING:
    from uc_checkpoint.volumes import Volume

logger = logging.getLogger(__name__)

_ABSENT = object()

#: Chunks per tensor above which the pairwise overlap check is skipped (volumes still must add up).
_MAX_PAIRWISE_CHUNKS = 2048


def is_allowed_global(module: str, name: str) -> bool:
    """Whether a ``.metadata`` pickle may name ``module.name``: an :data:`ALLOWED_GLOBALS` entry or
    a torch dtype (``torch.float32`` pickles as the global ``torch float32``)."""
    if (module, name) in ALLOWED_GLOBALS:
        return True
    # vars() rather than getattr: an exact attribute, never a dotted path or a lazily imported module.
    return module == "torch" and isinstance(vars(torch).get(name), torch.dtype)


class _EnumLookup:
    """What :class:`_RestrictedUnpickler` resolves ``builtins.getattr`` to: ``getattr`` for an enum
    member named by name (:func:`~uc_checkpoint.format.metadata_peek.enum_member_error`), refusing
    any other use. No ``__dict__``: a pickle cannot set state on it."""

    __slots__ = ("_where",)

    def __init__(self, where: str) -> None:
        self._where = where

    def __call__(self, *args: object) -> Any:
        owner, name = args if len(args) == 2 else (None, None)
        key = None
        if (
            isinstance(owner, type)
            and issubclass(owner, enum.Enum)
            and is_allowed_global(owner.__module__, owner.__qualname__)
        ):
            key = (owner.__module__, owner.__qualname__)
        error = enum_member_error(key, name, self._where)
        if error is not None:
            raise error
        return cast(type[enum.Enum], owner)[cast(str, name)]


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global :func:`is_allowed_global` does not accept.

    Pickle's BUILD opcode can also set attributes on a global it was handed (``setattr(Metadata,
    "__hash__", None)``), which would change that class for the rest of the process. So the
    attributes of every global it resolves are recorded, and :meth:`undo_global_changes` puts them
    back after the load.
    """

    def __init__(self, data: bytes, where: str) -> None:
        # fix_imports=False: Python 2 module names must not be remapped after the check.
        super().__init__(io.BytesIO(data), fix_imports=False)
        self._where = where
        self._before: dict[int, tuple[str, Any, dict[str, Any]]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in GETATTR_GLOBALS:
            return _EnumLookup(self._where)
        if not is_allowed_global(module, name):
            raise unsafe_global(module, name, self._where)
        obj = super().find_class(module, name)
        if hasattr(obj, "__dict__") and id(obj) not in self._before:
            self._before[id(obj)] = (f"{module}.{name}", obj, dict(vars(obj)))
        return obj

    def undo_global_changes(self) -> None:
        """Restore any attribute the pickle set on a resolved global.

        Raises:
            UnsafeMetadataError: something was changed (and has been put back).
        """
        changed = []
        for label, obj, before in self._before.values():
            now = dict(vars(obj))
            for attr in now.keys() - before.keys():
                delattr(obj, attr)
                changed.append(f"{label}.{attr}")
            for attr, value in before.items():
                if now.get(attr, _ABSENT) is not value:
                    setattr(obj, attr, value)
                    changed.append(f"{label}.{attr}")
        if changed:
            raise UnsafeMetadataError(
                f"refusing {self._where}: its pickle sets {', '.join(sorted(changed))} (restored); "
                "DCP metadata never does that"
            )


def _restricted_load(data: bytes, where: str) -> Any:
    unpickler = _RestrictedUnpickler(data, where)
    try:
        return unpickler.load()
    finally:
        # Also after a failed load: a pickle may change a class and then break off.
        unpickler.undo_global_changes()


def dump_metadata(metadata: Metadata) -> bytes:
    """The bytes of a ``.metadata`` file: DCP's pickle, then the checksum trailer
    (:data:`TRAILER_PREFIX`, the pickle's sha256 in hex, a newline). Stock ``FileSystemReader``
    unpickles the same bytes and ignores the trailer."""
    payload = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    return payload + TRAILER_PREFIX + hashlib.sha256(payload).hexdigest().encode() + b"\n"


def load_metadata(data: bytes, where: str, *, allow_unsafe: bool = False) -> Metadata:
    """Decode the bytes of a ``.metadata`` file and check them with :func:`check_metadata`.

    A ``.metadata`` with a checksum trailer (:func:`dump_metadata`) is checked against it before a
    byte is unpickled; one whose manifest says it was written with a trailer must have it.

    Args:
        data: the file's content.
        where: the file's path or URL, for messages.
        allow_unsafe: unpickle with plain :func:`pickle.loads`, which runs any code the file names.

    Raises:
        UnsafeMetadataError: the pickle names a global outside the allow-list (nothing it names
            has been called).
        CorruptCheckpointError: the bytes fail their checksum, are not a pickle (empty, truncated,
            garbage), do not hold a DCP ``Metadata``, or fail :func:`check_metadata`. The message
            names ``where``.
    """
    payload, digest = checked_payload(data, where)
    try:
        metadata = pickle.loads(payload) if allow_unsafe else _restricted_load(payload, where)
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # pickle raises many types on bad input (EOFError, KeyError, ...)
        raise CorruptCheckpointError(f"{where} is corrupt or truncated: {type(exc).__name__}: {exc}") from exc
    if allow_unsafe:
        logger.warning("%s was unpickled without restrictions (allow_unsafe_metadata=True)", where)
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} does not hold DCP Metadata (found {type(metadata).__name__})")
    check_trailer_kept(digest, getattr(metadata, layout.MANIFEST_ATTR, None), where)
    try:
        check_metadata(metadata, where)
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # objects of the right classes with missing or odd fields
        raise CorruptCheckpointError(f"{where} is malformed: {type(exc).__name__}: {exc}") from exc
    return metadata


def read_metadata(volume: Volume, rank: int | None = None, *, allow_unsafe: bool = False) -> Metadata:
    """Read, decode and check the ``.metadata`` (or DCP's rank-local ``__<rank>.metadata``) of the
    checkpoint at ``volume``: one GET, then :func:`load_metadata`. What every tool that needs a
    checkpoint's metadata calls (``UCVolumeReader.load_metadata`` does the same for a load).

    Args:
        volume: the checkpoint's location.
        rank: read the rank-local metadata of this rank instead.
        allow_unsafe: see :func:`load_metadata`.

    Raises:
        CheckpointNotFoundError: the file does not exist (never saved, or the save did not finish).
        UnsafeMetadataError / CorruptCheckpointError: see :func:`load_metadata`.
        TransferError / VolumeError: the store failed to return the file (after its client's retries).
    """
    name = layout.metadata_name(rank)
    data = volume.read_bytes(name)
    if data is None:
        raise CheckpointNotFoundError(
            f"no checkpoint at {volume.url}: {volume.url_of(name)} does not exist "
            "(never saved, or the save did not finish)"
        )
    return load_metadata(data, volume.url_of(name), allow_unsafe=allow_unsafe)


def manifest_of(metadata: Metadata) -> Mapping[str, Any] | None:
    """The manifest dict stored in ``metadata`` (``uc_manifest``), or ``None`` for checkpoints
    written by other writers or in a format this release does not read."""
    raw = getattr(metadata, layout.MANIFEST_ATTR, None)
    return raw if manifest_format.is_readable(raw) else None


def referenced_files(metadata: Metadata) -> dict[str, int]:
    """Data files the metadata points at, with the minimum size each must have (end of the last
    item stored in it, in bytes)."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        need[name] = max(need.get(name, 0), info.offset + info.length)
    return need


def data_file_names(metadata: Metadata) -> set[str]:
    """Every data file a checkpoint's metadata refers to: in its storage data or its manifest."""
    return set(referenced_files(metadata)) | set(manifest_format.entries_of(manifest_of(metadata)))


def check_metadata(metadata: Metadata, where: str) -> None:
    """Check what a load would act on before any data file is read: every ``storage_data`` entry is
    a ``_StorageInfo`` with a plain file name (:func:`bad_file_name`) and a non-negative offset and
    length, and our manifest, if present, is well-formed and names only plain files.

    Raises:
        CorruptCheckpointError: naming ``where`` and the offending entry.
    """
    storage = storage_mapping(metadata.storage_data, where)
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{where}: storage entry for {index} is a {type(info).__name__}")
        check_storage_entry(index, info.relative_path, info.offset, info.length, info.transform_descriptors, where)
    _check_items(metadata, storage, where)
    manifest = manifest_of(metadata)
    if manifest is not None:
        check_manifest(manifest, where)


def _numel(sizes: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return n


def _check_items(metadata: Metadata, storage: Mapping[Any, Any], where: str) -> None:
    """Every item of ``state_dict_metadata`` is well-formed, and what a load would write is whole:
    each tensor's chunks lie inside it and tile it exactly once (a chunk shrunk by one flipped byte
    would otherwise leave part of the target tensor unwritten, without an error), each chunk and
    each bytes item has a storage entry, and each stored tensor item is at least as long as its
    chunk's bytes (unless stored through stream extensions).

    Raises:
        CorruptCheckpointError: naming ``where`` and the item.
    """
    items = metadata.state_dict_metadata
    if not isinstance(items, Mapping):
        raise CorruptCheckpointError(f"{where}: state_dict_metadata is a {type(items).__name__}, not a mapping")
    for fqn, md in items.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: an item key is a {type(fqn).__name__}, not a string")
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise CorruptCheckpointError(f"{where}: item {fqn!r} has no storage entry")
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{where}: item {fqn!r} is a {type(md).__name__}")
        _check_tensor(fqn, md, storage, where)


def _check_tensor(fqn: str, md: TensorStorageMetadata, storage: Mapping[Any, Any], where: str) -> None:
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: tensor {fqn!r} {why}")

    size = tuple(md.size) if isinstance(md.size, (tuple, list, torch.Size)) else None
    if size is None or not all(isinstance(d, int) and d >= 0 for d in size):
        raise bad(f"has a malformed size {md.size!r}")
    dtype = getattr(md.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise bad(f"has no dtype ({dtype!r})")
    itemsize = dtype.itemsize
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    total = 0
    for chunk in md.chunks:
        offsets, sizes = tuple(getattr(chunk, "offsets", ())), tuple(getattr(chunk, "sizes", ()))
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or not all(isinstance(v, int) and v >= 0 for v in (*offsets, *sizes))
        ):
            raise bad(f"has a malformed chunk (offsets {offsets!r}, sizes {sizes!r}) for size {size}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise bad(f"has a chunk at {offsets} of {sizes} reaching outside its size {size}")
        info = storage.get(MetadataIndex(fqn, offsets))
        if info is None:
            raise bad(f"has no storage entry for its chunk at {offsets}")
        volume = _numel(sizes)
        # A transformed item (DCP's stream extensions, e.g. compression) stores fewer bytes.
        if not info.transform_descriptors and info.length < volume * itemsize:
            raise bad(
                f"chunk at {offsets} is stored in {info.length} bytes, fewer than its {volume * itemsize} bytes of data"
            )
        boxes.append((offsets, sizes))
        total += volume
    if total != _numel(size):
        raise bad(f"has chunks covering {total} elements, its size {size} has {_numel(size)}")
    if len(boxes) <= _MAX_PAIRWISE_CHUNKS:
        for i, (oa, sa) in enumerate(boxes):
            for ob, sb in boxes[i + 1 :]:
                if all(a < b + lb and b < a + la for a, la, b, lb in zip(oa, sa, ob, sb)) and _numel(sa) and _numel(sb):
                    raise bad(f"has overlapping chunks at {oa} and {ob}")
