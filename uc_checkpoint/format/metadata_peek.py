"""What a checkpoint's ``.metadata`` references, read without torch; and the torch-free rules every
reader of a ``.metadata`` applies (its checksum trailer, the globals its pickle may name, the file
names it may hold).

``.metadata`` is DCP's pickled ``Metadata``. Decoding it for real
(:func:`uc_checkpoint.dcp.metadata_io.load_metadata`) builds torch's classes, so it imports torch:
seconds, which a listing (``uc-checkpoint ls``) should not pay. What a listing needs is our manifest
(the plain dict ``uc_manifest``, see :mod:`uc_checkpoint.format.layout`) and, for checkpoints
without one (stock DCP writers), each storage entry's ``relative_path``, ``offset`` and ``length``.
:func:`peek_metadata` unpickles the same bytes with an unpickler that never imports or calls
anything real: each global the pickle may name (:data:`ALLOWED_GLOBALS`, torch dtypes by name,
:data:`TORCH_DTYPE_NAMES`) becomes an inert stand-in class, made for that one load; every other
global is refused, as the real decoder refuses it. It then applies the checks the real decoder makes
of the root object, the storage entries and the manifest, with the same messages, but not those of
the items (``state_dict_metadata``: chunks tiling each tensor), which need torch's dtypes and matter
to a load, not to a listing.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from uc_checkpoint.errors import CorruptCheckpointError, UnsafeMetadataError
from uc_checkpoint.format import layout
from uc_checkpoint.format import manifest as manifest_format

#: The checksum trailer after the pickle in ``.metadata``: ``pickle.load`` stops at the pickle's
#: STOP opcode, so stock readers never see it, and every byte before it is covered by its sha256.
TRAILER_PREFIX = b"\nuc-checkpoint-metadata sha256="
_TRAILER = re.compile(rb"\nuc-checkpoint-metadata sha256=([0-9a-f]{64})\n\Z")

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: ``(module, name)`` of DCP's ``Metadata``, the root object of every ``.metadata``.
METADATA_GLOBAL = (_DCP_METADATA, "Metadata")
#: ``(module, name)`` of DCP's ``_StorageInfo``, the value of every ``storage_data`` entry.
STORAGE_INFO_GLOBAL = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")

#: ``(module, name)`` of every global a ``.metadata`` pickle may name, besides torch dtypes.
#: Each is a plain data class or a function that only looks a value up; none runs code it is given.
#: Taken from every global seen while unpickling checkpoints saved by ``UCVolumeWriter`` and by
#: DCP's ``FileSystemWriter`` (torch 2.13, Python 3.11; tensors of 15 dtypes from float8 to
#: complex128, channels-last, requires_grad, empty and 0-d tensors, nested dicts, lists and plain
#: objects; with and without the flattening planner; ``checkpoint_id`` as str and as Path). A few
#: entries name the same classes where other torch or Python versions put them; each is commented.
#: ``tests/unit/test_hostile_input.py`` re-checks real checkpoints against the list.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        METADATA_GLOBAL,
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties pickles its memory format as this enum
        STORAGE_INFO_GLOBAL,
        # Older torch releases (2.0 era) defined DCP's TensorProperties here; their checkpoints name these.
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided")
        # FileSystemWriter stores its path (a pathlib.Path) as StorageMeta.checkpoint_id. Python 3.13
        # pickles the classes as pathlib._local.*.
        *(
            (module, cls)
            for module in ("pathlib", "pathlib._local")
            for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
        ),
    }
)

#: The enum classes among :data:`ALLOWED_GLOBALS`, with their member names as torch 2.13 defines
#: them. Python 3.11's first releases (3.11.2, Debian 12's, among them) pickle an enum member by name,
#: as ``getattr(EnumClass, "NAME")``; later releases pickle it by value (``EnumClass(value)``). So
#: ``builtins.getattr`` is accepted in exactly that form: its first argument one of these classes,
#: its second one of that class's member names (:data:`GETATTR_GLOBALS`). A test checks these names
#: agree with torch's enums.
ENUM_MEMBERS: dict[tuple[str, str], frozenset[str]] = {
    key: frozenset({"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"})
    for key in (
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    )
}

#: ``(module, name)`` of ``getattr``, which a ``.metadata`` pickle may name only to look up an enum
#: member by name (:data:`ENUM_MEMBERS`): ``builtins``, or ``__builtin__`` as pickle protocols 0 to
#: 2 spell it (Python 3 writes Python 2's module names there).
GETATTR_GLOBALS = frozenset({("builtins", "getattr"), ("__builtin__", "getattr")})


def enum_member_error(owner: object, name: object, where: str) -> UnsafeMetadataError | None:
    """Why ``getattr(owner, name)`` in the ``.metadata`` at ``where`` is refused, or None when it is
    the by-name form of an enum member (:data:`ENUM_MEMBERS`).

    Args:
        owner: the ``(module, name)`` of the global the pickle passed as the first argument, or None
            when it passed anything but a global of :data:`ENUM_MEMBERS`.
        name: the pickle's second argument.
        where: the file's path or URL, for messages.
    """
    members = ENUM_MEMBERS.get(owner) if isinstance(owner, tuple) else None
    if members is None:
        why = (
            f"a .metadata may use it only to name a member of {' or '.join(sorted('.'.join(k) for k in ENUM_MEMBERS))}"
        )
    elif not isinstance(name, str) or name not in members:
        why = f"{name!r} is not a member of {'.'.join(cast(tuple[str, str], owner))}"
    else:
        return None
    return UnsafeMetadataError(
        f"refusing to unpickle builtins.getattr from {where}: {why}; pass allow_unsafe_metadata=True to "
        "UCVolumeReader only if you trust this checkpoint"
    )


#: The names of torch's dtypes (``torch.float32`` pickles as the global ``torch float32``), aliases
#: included, as torch 2.13 defines them: what :func:`peek_metadata` accepts as ``torch.<name>``
#: without importing torch. The real decoder asks torch itself; a test checks the two agree, so a
#: dtype a later torch adds is added here.
TORCH_DTYPE_NAMES: frozenset[str] = frozenset(
    {
        *("bool", "bfloat16", "half", "float", "double", "long", "int", "short"),
        *("float16", "float32", "float64", "complex32", "complex64", "complex128", "cfloat", "cdouble", "chalf"),
        *("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"),
        "float4_e2m1fn_x2",
        *(f"int{bits}" for bits in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)),
        *(f"uint{bits}" for bits in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)),
        *("qint8", "qint32", "quint8", "quint2x4", "quint4x2"),
        *("bit", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"),
    }
)


def split_trailer(data: bytes) -> tuple[bytes, str | None]:
    """``(pickle bytes, sha256 hex)`` of a ``.metadata`` with a checksum trailer, or
    ``(data, None)`` for one without (stock writers, our formats 1 and 2, or a damaged trailer)."""
    match = _TRAILER.search(data, max(0, len(data) - len(TRAILER_PREFIX) - 65))
    if match is None:
        return data, None
    return data[: match.start()], match.group(1).decode()


def checked_payload(data: bytes, where: str) -> tuple[bytes, str | None]:
    """:func:`split_trailer` of a ``.metadata``'s bytes, the pickle checked against its trailer's
    sha256 when it has one. Nothing should unpickle a byte of a ``.metadata`` that fails it.

    Raises:
        CorruptCheckpointError: the pickle fails its checksum (naming ``where``).
    """
    payload, digest = split_trailer(data)
    if digest is not None:
        actual = hashlib.sha256(payload).hexdigest()
        if actual != digest:
            raise CorruptCheckpointError(
                f"{where} fails its checksum (sha256 {actual[:16]}..., recorded {digest[:16]}...): "
                "the file was damaged or changed after it was written"
            )
    return payload, digest


def check_trailer_kept(digest: str | None, manifest: object, where: str) -> None:
    """Refuse a ``.metadata`` without a checksum trailer (``digest`` None) whose manifest (its
    ``uc_manifest`` as found) says it was written with one (:func:`~uc_checkpoint.format.manifest.needs_trailer`).

    Raises:
        CorruptCheckpointError: the trailer is lost (the file damaged or truncated at its end).
    """
    if digest is None and manifest_format.needs_trailer(manifest):
        raise CorruptCheckpointError(
            f"{where} has lost the checksum trailer it was written with (damaged or truncated at its end)"
        )


def unsafe_global(module: str, name: str, where: str) -> UnsafeMetadataError:
    """The error for a ``.metadata`` pickle (at ``where``) that names the global ``module.name``,
    which is not part of DCP's metadata format."""
    return UnsafeMetadataError(
        f"refusing to unpickle {module}.{name} from {where}: it is not part of DCP's "
        "metadata format and could run code; pass allow_unsafe_metadata=True to UCVolumeReader "
        "only if you trust this checkpoint"
    )


def bad_file_name(name: object) -> str | None:
    """Why ``name`` is not a plain file name inside a checkpoint location, or ``None``.

    A name must be a non-empty string without ``/`` (absolute paths, other directories, URLs such
    as ``s3://other-bucket/x``), ``\\`` (Windows separators), ``:`` (drive letters and URL schemes),
    NUL, and must not be ``.`` or ``..``. The one ``/`` allowed is that of a data file in a spread
    prefix (:func:`uc_checkpoint.format.layout.spread_dir`): one to two lower-case hex digits, ``/``,
    then a plain name ending in ``.distcp``.
    """
    if not isinstance(name, str):
        return f"it is a {type(name).__name__}, not a string"
    head, sep, tail = name.partition("/")
    if sep and layout.is_spread_dir(head + sep) and tail.endswith(layout.DATA_SUFFIX):
        name = tail  # a spread prefix's data file: its own name must be plain
    if not name:
        return "it is empty"
    if name in (".", ".."):
        return "it names a directory"
    for char, why in (("\0", "NUL"), ("/", "'/'"), ("\\", "'\\'"), (":", "':'")):
        if char in name:
            return f"it contains {why}"
    return None


def check_file_name(name: object, where: str, what: str) -> None:
    """Refuse a ``.metadata`` (at ``where``) naming a ``what`` (``"data file"``, ``"manifest
    entry"``) that is not a plain file of the checkpoint (:func:`bad_file_name`).

    Raises:
        CorruptCheckpointError: naming ``where``, ``name`` and why.
    """
    reason = bad_file_name(name)
    if reason is not None:
        raise CorruptCheckpointError(
            f"{where} names {what} {name!r} outside the checkpoint ({reason}; "
            "a checkpoint's files must be plain names in its location)"
        )


# ---- the checks of what a .metadata names --------------------------------------------------------


def storage_mapping(storage: object, where: str) -> Mapping[Any, Any]:
    """A ``Metadata``'s ``storage_data`` as the mapping it must be (None: no entries).

    Raises:
        CorruptCheckpointError: it is not a mapping (naming ``where``).
    """
    if storage is None:
        return {}
    if not isinstance(storage, Mapping):
        raise CorruptCheckpointError(f"{where}: storage_data is a {type(storage).__name__}, not a mapping")
    return storage


def check_storage_entry(
    index: object, name: object, offset: object, length: object, descriptors: object, where: str
) -> int:
    """Check the fields of one storage entry (the ``_StorageInfo`` of ``index``): ``name``
    (``relative_path``) a plain file of the checkpoint (:func:`check_file_name`), ``offset`` and
    ``length`` non-negative integers (bytes), ``descriptors`` (``transform_descriptors``) None or
    a sequence of strings. Returns where the item ends in its file (``offset + length``, bytes).

    Raises:
        CorruptCheckpointError: naming ``where`` and the offending field.
    """
    check_file_name(name, where, "data file")
    for field, value in (("offset", offset), ("length", length)):
        if not isinstance(value, int) or value < 0:
            raise CorruptCheckpointError(f"{where}: {name!r} has {field} {value!r}")
    if descriptors is not None and (
        isinstance(descriptors, str)
        or not isinstance(descriptors, (list, tuple))
        or not all(isinstance(d, str) for d in descriptors)
    ):
        raise CorruptCheckpointError(f"{where}: storage entry for {index} has transform descriptors {descriptors!r}")
    return cast(int, offset) + cast(int, length)  # both checked above


def check_manifest(manifest: Mapping[str, Any], where: str) -> None:
    """Check our manifest (a readable one, see :func:`~uc_checkpoint.format.manifest.is_readable`):
    its files are a mapping of plain file names (:func:`check_file_name`) to well-formed records.

    Raises:
        CorruptCheckpointError: naming ``where`` and what is wrong.
    """
    files = manifest.get("files") or {}
    if not isinstance(files, Mapping):
        raise CorruptCheckpointError(f"{where}: the manifest's files are a {type(files).__name__}, not a mapping")
    for name in files:
        check_file_name(name, where, "manifest entry")
    try:
        manifest_format.entries_of(manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: the file manifest is malformed: {type(exc).__name__}: {exc}") from exc


# ---- inert stand-ins -----------------------------------------------------------------------------

#: DCP's dataclasses that :func:`peek_metadata` reads or names in messages: their fields in order,
#: and how many of the first have no default (the others default to None). A pickle that calls one
#: (REDUCE) fills them as its ``__init__`` does; messages show them as its ``repr`` does.
_DATACLASS_FIELDS: dict[tuple[str, str], tuple[tuple[str, ...], int]] = {
    METADATA_GLOBAL: (("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"), 1),
    STORAGE_INFO_GLOBAL: (("relative_path", "offset", "length", "transform_descriptors"), 3),
    (_DCP_METADATA, "MetadataIndex"): (("fqn", "offset", "index"), 1),
}
#: The allowed classes with a ``__setstate__`` of their own, which take a BUILD state of any form
#: (a tuple); pickle gives every other class a state dict (or ``(state, slot state)``).
_OWN_SETSTATE = frozenset(
    {(_DCP_METADATA, "TensorProperties"), ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties")}
)


class _BuildState:
    """``__setstate__`` of the stand-ins, which pickle's BUILD looks up: on an instance it keeps
    the state as pickle applies one to a class without ``__setstate__``; on a stand-in class
    itself (a pickle that sets attributes of a global) it refuses the file."""

    def __get__(self, instance: _StandIn | None, owner: type[_StandIn]) -> Any:
        if instance is None:
            return _refuse_build(owner)
        return instance._build


def _refuse_build(owner: type[_StandIn]) -> Any:
    def refuse(state: object) -> None:
        module, name = owner._uc_global
        parts = state if isinstance(state, tuple) else (state,)
        attrs = sorted(f"{module}.{name}.{key}" for part in parts if isinstance(part, Mapping) for key in part)
        raise UnsafeMetadataError(
            f"refusing {owner._uc_where}: its pickle sets {', '.join(attrs) or f'attributes of {module}.{name}'}; "
            "DCP metadata never does that"
        )

    return refuse


class _StandIn:
    """Base of the stand-ins :func:`peek_metadata` puts in place of the globals a pickle names.

    An instance takes any constructor arguments and any BUILD state and keeps them as data; it has
    no behaviour of its own (no ``__call__``, ``__getattr__``, item access, comparisons or hashing
    but by identity), so nothing in the pickle runs through it. Each load makes its own subclasses
    (:class:`_InertUnpickler`), so nothing a pickle does to one reaches another load.
    """

    __slots__ = ("_args", "_fields")
    #: ``(module, name)`` of the global this class stands in for.
    _uc_global: ClassVar[tuple[str, str]]
    #: The ``.metadata`` being read, for messages.
    _uc_where: ClassVar[str]
    _args: tuple[object, ...]
    _fields: dict[Any, Any]

    __setstate__ = _BuildState()

    def __new__(cls, *args: object, **kwargs: object) -> _StandIn:
        # NEWOBJ calls only this: a dataclass's object.__new__ ignores its arguments.
        self = object.__new__(cls)
        self._args, self._fields = args, {}
        return self

    def __init__(self, *args: object, **kwargs: object) -> None:
        # Only a call (REDUCE) gets here, with positional arguments only: as a dataclass's __init__.
        names, required = _DATACLASS_FIELDS.get(self._uc_global, ((), 0))
        if not names:
            return
        if not required <= len(args) <= len(names):
            raise TypeError(f"{self._uc_global[1]}() takes {required} to {len(names)} arguments ({len(args)} given)")
        self._fields.update(zip(names, (*args, *(None,) * (len(names) - len(args)))))

    def _build(self, state: object) -> None:
        # As pickle applies a state to a class without __setstate__ (and with its errors): a state
        # dict, or (state dict or None, slot state dict or None). A class with its own
        # (TensorProperties) takes any form; nothing of it is read.
        if self._uc_global in _OWN_SETSTATE:
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for part, what in ((state, "state"), (slots, "slot state")):
            if part is not None and not isinstance(part, dict):
                raise pickle.UnpicklingError(f"{what} is not a dictionary")
            self._fields.update(part or {})

    @reprlib.recursive_repr()
    def __repr__(self) -> str:
        module, name = self._uc_global
        if (module, name) == ("torch", "Size") and len(self._args) == 1 and isinstance(self._args[0], (tuple, list)):
            return f"torch.Size({list(self._args[0])!r})"
        names, required = _DATACLASS_FIELDS.get((module, name), ((), 0))
        if names and all(n in self._fields for n in names[:required]):
            parts = [f"{n}={self._fields.get(n)!r}" for n in names]
        else:
            parts = [repr(a) for a in self._args] + [f"{k}={v!r}" for k, v in self._fields.items()]
        return f"{name}({', '.join(parts)})"


def _is(obj: object, key: tuple[str, str]) -> bool:
    """Whether ``obj`` is an instance of the stand-in for the global ``key``."""
    return isinstance(obj, _StandIn) and type(obj)._uc_global == key


def _field(obj: _StandIn, fields: Mapping[Any, Any], name: str, where: str) -> Any:
    """``obj``'s attribute ``name``, a dataclass field without a default.

    Raises:
        CorruptCheckpointError: the pickle did not set it (worded as the real decoder words it).
    """
    if name not in fields:
        raise CorruptCheckpointError(
            f"{where} is malformed: AttributeError: '{type(obj).__name__}' object has no attribute '{name}'"
        )
    return fields[name]


class _InertEnumLookup:
    """What :class:`_InertUnpickler` puts in place of ``builtins.getattr``: called with a stand-in
    enum class and a member name (:func:`enum_member_error`), it gives an instance of that stand-in
    holding the name; anything else is refused. No ``__dict__``: a pickle cannot set state on it."""

    __slots__ = ("_where",)

    def __init__(self, where: str) -> None:
        self._where = where

    def __call__(self, *args: object) -> _StandIn:
        owner, name = args if len(args) == 2 else (None, None)
        key = owner._uc_global if isinstance(owner, type) and issubclass(owner, _StandIn) else None
        error = enum_member_error(key, name, self._where)
        if error is not None:
            raise error
        member = object.__new__(cast(type[_StandIn], owner))
        member._args, member._fields = (), {"_name_": name}
        return member


class _InertUnpickler(pickle.Unpickler):
    """An unpickler whose globals are inert stand-ins (:class:`_StandIn`) of the globals a
    ``.metadata`` may name, made for this load; any other global is refused, nothing imported."""

    def __init__(self, data: bytes, where: str) -> None:
        # fix_imports=False: Python 2 module names are not remapped (find_class sees them as named).
        super().__init__(io.BytesIO(data), fix_imports=False)
        self._where = where
        self._classes: dict[tuple[str, str], type[_StandIn]] = {}

    def find_class(self, module: str, name: str) -> Any:
        # No persistent_load: pickle refuses persistent ids, as for the real decoder.
        key = (module, name)
        if key in GETATTR_GLOBALS:
            return _InertEnumLookup(self._where)
        if key not in ALLOWED_GLOBALS and not (module == "torch" and name in TORCH_DTYPE_NAMES):
            raise unsafe_global(module, name, self._where)
        cls = self._classes.get(key)
        if cls is None:
            namespace = {"__slots__": (), "__module__": module, "__qualname__": name}
            cls = type(name, (_StandIn,), {**namespace, "_uc_global": key, "_uc_where": self._where})
            self._classes[key] = cls
        return cls


# ---- the peek ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeekedMetadata:
    """What a checkpoint's ``.metadata`` references, as :func:`peek_metadata` read it.

    Attributes:
        manifest: our file manifest (``uc_manifest``, see :mod:`uc_checkpoint.format.layout`), or
            None for checkpoints written by other writers or in a format this release does not read
            (as :func:`uc_checkpoint.dcp.metadata_io.manifest_of` gives it).
        referenced: every data file the storage entries point at (relative to the checkpoint), with
            the least size it must have: the end of the last item stored in it, in bytes (as
            :func:`uc_checkpoint.dcp.metadata_io.referenced_files` gives it).
    """

    manifest: Mapping[str, Any] | None
    referenced: dict[str, int]

    @property
    def save_id(self) -> str | None:
        """The save that wrote the checkpoint, from its manifest (None without one)."""
        save_id = (self.manifest or {}).get("save_id")
        return save_id if isinstance(save_id, str) else None

    def file_names(self) -> set[str]:
        """Every data file the ``.metadata`` refers to: in its storage entries or its manifest (as
        :func:`uc_checkpoint.dcp.metadata_io.data_file_names` gives them)."""
        return set(self.referenced) | set(manifest_format.entries_of(self.manifest))


def peek_metadata(raw: bytes, where: str) -> PeekedMetadata:
    """What the ``.metadata`` bytes ``raw`` reference, without torch and without running anything
    the pickle names.

    Checked as :func:`uc_checkpoint.dcp.metadata_io.load_metadata` checks them, with its messages:
    the checksum trailer (:func:`checked_payload`, :func:`check_trailer_kept`), the globals the
    pickle names (:data:`ALLOWED_GLOBALS`, :data:`TORCH_DTYPE_NAMES`), that it holds DCP's
    ``Metadata``, that every storage entry is a ``_StorageInfo`` naming a plain file
    (:func:`check_file_name`) with a non-negative offset and length, and that the manifest, if
    any, is well-formed and names only plain files. Not checked: the items (chunks and their
    storage entries), which only a load acts on.

    Args:
        raw: the file's content.
        where: the file's path or URL, for messages.

    Raises:
        UnsafeMetadataError: the pickle names a global outside the allow-list, or sets attributes
            of one (nothing it names has been imported or called).
        CorruptCheckpointError: the bytes fail their checksum, are not a pickle (empty, truncated,
            garbage), do not hold a DCP ``Metadata`` or fail a check above; the message names ``where``.
    """
    payload, digest = checked_payload(raw, where)
    try:
        root = _InertUnpickler(payload, where).load()
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # pickle raises many types on bad input (EOFError, KeyError, ...)
        raise CorruptCheckpointError(f"{where} is corrupt or truncated: {type(exc).__name__}: {exc}") from exc
    if not _is(root, METADATA_GLOBAL):
        raise CorruptCheckpointError(f"{where} does not hold DCP Metadata (found {type(root).__name__})")
    fields = root._fields
    raw_manifest = fields.get(layout.MANIFEST_ATTR)
    check_trailer_kept(digest, raw_manifest, where)
    referenced: dict[str, int] = {}
    for index, info in storage_mapping(fields.get("storage_data"), where).items():
        if not _is(info, STORAGE_INFO_GLOBAL):
            raise CorruptCheckpointError(f"{where}: storage entry for {index} is a {type(info).__name__}")
        entry = info._fields
        name, offset, length = (_field(info, entry, f, where) for f in ("relative_path", "offset", "length"))
        end = check_storage_entry(index, name, offset, length, entry.get("transform_descriptors"), where)
        referenced[name] = max(referenced.get(name, 0), end)
    manifest = raw_manifest if manifest_format.is_readable(raw_manifest) else None
    if manifest is not None:
        check_manifest(manifest, where)
    return PeekedMetadata(manifest=manifest, referenced=referenced)


__all__ = [
    "ALLOWED_GLOBALS",
    "METADATA_GLOBAL",
    "STORAGE_INFO_GLOBAL",
    "TORCH_DTYPE_NAMES",
    "TRAILER_PREFIX",
    "PeekedMetadata",
    "bad_file_name",
    "check_file_name",
    "check_manifest",
    "check_storage_entry",
    "check_trailer_kept",
    "checked_payload",
    "peek_metadata",
    "split_trailer",
    "storage_mapping",
    "unsafe_global",
]
