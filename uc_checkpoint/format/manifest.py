"""The file manifest a checkpoint carries in its ``.metadata``, as typed values.

uc_checkpoint stores a manifest of every data file (size in bytes, CRC-32 of the whole file and of
each block) as the plain-dict attribute ``uc_manifest`` of DCP's ``Metadata`` (see
:mod:`uc_checkpoint.format.layout` for the shape). Stock readers ignore the attribute, and the pickled dict
is the on-volume format, so it stays a dict of built-in types. :class:`Manifest` and
:class:`ManifestEntry` are its typed view: :meth:`Manifest.from_dict` owns the checks of that dict
(readable formats, the ``files`` records) and :meth:`Manifest.to_dict` builds exactly the dict the
writers have always pickled (same keys, same order, same types), so a checkpoint reads the same
whichever release wrote it.

The idea of pure functions over typed manifest entries, independent of storage, is torchsnapshot's
(``manifest.py``/``manifest_ops.py``). This module is torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from uc_checkpoint.format.integrity import FileRecord

#: The format this release writes.
MANIFEST_FORMAT = 3
#: Formats this release reads: 1 (first release: no per-block checksums), 2 (per-block checksums),
#: 3 (as 2, and the ``.metadata`` ends with a checksum trailer).
READABLE_FORMATS: tuple[int, ...] = (1, 2, 3)
#: Manifest formats whose ``.metadata`` must carry the checksum trailer.
TRAILER_FORMATS: tuple[int, ...] = (3,)
#: Formats whose entries carry ``block_size``/``blocks``.
_BLOCK_FORMATS = (2, 3)


def is_readable(raw: object) -> bool:
    """Whether ``raw`` (a ``uc_manifest`` attribute as found) is a manifest of a readable format.
    Anything else (another writer's attribute, a future format) is treated as no manifest at all."""
    return isinstance(raw, Mapping) and raw.get("format") in READABLE_FORMATS


def needs_trailer(raw: object) -> bool:
    """Whether ``raw`` says its ``.metadata`` was written with the checksum trailer."""
    return isinstance(raw, Mapping) and raw.get("format") in TRAILER_FORMATS


@dataclass(frozen=True)
class ManifestEntry:
    """One data file of a checkpoint, as its manifest records it.

    Attributes:
        name: the file's name at the checkpoint location, relative to it (``<spread>/<name>`` for a
            data file in a spread prefix, see :mod:`uc_checkpoint.format.layout`; readers check
            every name with :func:`uc_checkpoint.dcp.metadata_io.bad_file_name`).
        size: bytes.
        crc32: CRC-32 of the whole file, 8 lowercase hex digits.
        block_size: bytes per block of ``blocks`` (0: no per-block checksums, format 1).
        blocks: CRC-32 of each block, big-endian uint32 each.
    """

    name: str
    size: int
    crc32: str
    block_size: int = 0
    blocks: bytes = b""

    @classmethod
    def from_dict(cls, name: str, raw: Mapping[str, Any]) -> ManifestEntry:
        """The entry of ``name`` from its manifest dict ``{"size", "crc32"[, "block_size", "blocks"]}``.

        Values are converted as the readers always have (``int``, ``str``, ``bytes``).

        Raises:
            KeyError: ``size`` or ``crc32`` is missing.
            TypeError / ValueError / AttributeError: a value does not convert (``raw`` is not a
                mapping, a size that is not a number...).
        """
        return cls(
            name=name,
            size=int(raw["size"]),
            crc32=str(raw["crc32"]),
            block_size=int(raw.get("block_size", 0)),
            blocks=bytes(raw.get("blocks", b"")),
        )

    def to_dict(self, format: int = MANIFEST_FORMAT) -> dict[str, Any]:
        """The entry's dict in manifest ``format`` (format 1 has no block checksums)."""
        out: dict[str, Any] = {"size": self.size, "crc32": self.crc32}
        if format in _BLOCK_FORMATS:
            out["block_size"] = self.block_size
            out["blocks"] = self.blocks
        return out

    @classmethod
    def from_record(cls, record: FileRecord) -> ManifestEntry:
        """The entry of what a volume reported for an uploaded file."""
        return cls(record.name, record.size, record.crc32, record.block_size, record.block_crc32)

    def to_record(self) -> FileRecord:
        """The entry as the :class:`FileRecord` downloads are checked against."""
        return FileRecord(
            name=self.name, size=self.size, crc32=self.crc32, block_size=self.block_size, block_crc32=self.blocks
        )


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's file manifest.

    Attributes:
        save_id: the save that wrote the checkpoint (None only in hand-made manifests).
        files: every data file of the save, by name.
        format: the manifest format (:data:`MANIFEST_FORMAT` for new saves).
        checksum: the checksum kind of ``files`` (``"crc32"``).
        saved_by: ``{"host": str, "pid": int, "time": unix seconds}`` of the publishing process, or
            None (manifests before 0.1).
    """

    save_id: str | None
    files: Mapping[str, ManifestEntry] = field(default_factory=dict)
    format: int = MANIFEST_FORMAT
    checksum: str | None = "crc32"
    saved_by: Mapping[str, Any] | None = None

    @classmethod
    def build(cls, save_id: str, records: Iterable[FileRecord], saved_by: Mapping[str, Any] | None = None) -> Manifest:
        """The manifest of a new save (format :data:`MANIFEST_FORMAT`) of the files ``records``."""
        return cls(
            save_id=save_id,
            files={r.name: ManifestEntry.from_record(r) for r in records},
            saved_by=None if saved_by is None else dict(saved_by),
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Manifest:
        """The typed view of a ``uc_manifest`` dict. Keys this release does not know are ignored.

        Raises:
            ValueError: the format is not one of :data:`READABLE_FORMATS` (see :func:`is_readable`:
                readers treat such a manifest as absent rather than call this).
            TypeError: ``raw`` or its ``files`` is not a mapping, or ``save_id`` is not a string.
            KeyError / TypeError / ValueError / AttributeError: a ``files`` record is malformed
                (:meth:`ManifestEntry.from_dict`).
        """
        if not isinstance(raw, Mapping):
            raise TypeError(f"a manifest is a mapping, not a {type(raw).__name__}")
        if raw.get("format") not in READABLE_FORMATS:
            raise ValueError(f"unknown manifest format {raw.get('format')!r} (readable: {READABLE_FORMATS})")
        save_id = raw.get("save_id")
        if save_id is not None and not isinstance(save_id, str):
            raise TypeError(f"the manifest's save_id is a {type(save_id).__name__}, not a string")
        saved_by = raw.get("saved_by")
        return cls(
            save_id=save_id,
            files=entries_of(raw),
            format=int(raw["format"]),
            checksum=raw.get("checksum"),
            saved_by=dict(saved_by) if isinstance(saved_by, Mapping) else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The dict pickled into ``.metadata`` as ``uc_manifest``: ``{"format", "save_id",
        "checksum", "files": {name: entry dict}[, "saved_by"]}``, in that key order."""
        out: dict[str, Any] = {
            "format": self.format,
            "save_id": self.save_id,
            "checksum": self.checksum,
            "files": {name: entry.to_dict(self.format) for name, entry in self.files.items()},
        }
        if self.saved_by is not None:
            out["saved_by"] = dict(self.saved_by)
        return out

    def records(self) -> dict[str, FileRecord]:
        """The files as :class:`FileRecord` by name."""
        return {name: entry.to_record() for name, entry in self.files.items()}

    @property
    def needs_trailer(self) -> bool:
        """Whether the ``.metadata`` holding this manifest must end with the checksum trailer."""
        return self.format in TRAILER_FORMATS


def entries_of(raw: Mapping[str, Any] | None) -> dict[str, ManifestEntry]:
    """The ``files`` records of a manifest dict (none for ``None`` or a manifest without files),
    without judging the rest of it.

    Raises:
        TypeError: ``files`` is not a mapping.
        KeyError / TypeError / ValueError / AttributeError: a record is malformed.
    """
    files = (raw or {}).get("files") or {}
    if not isinstance(files, Mapping):
        raise TypeError(f"the manifest's files are a {type(files).__name__}, not a mapping")
    return {name: ManifestEntry.from_dict(name, entry) for name, entry in files.items()}


__all__ = [
    "MANIFEST_FORMAT",
    "READABLE_FORMATS",
    "TRAILER_FORMATS",
    "Manifest",
    "ManifestEntry",
    "entries_of",
    "is_readable",
    "needs_trailer",
]
