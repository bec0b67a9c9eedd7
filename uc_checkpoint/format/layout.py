"""What a checkpoint location holds, and the file manifest recorded in its ``.metadata``.

A checkpoint is DCP's standard layout: data files ``__<rank>_<save token>_<n>.distcp`` and a pickled
``Metadata`` in ``.metadata`` (or ``__<rank>.metadata`` per rank when DCP runs without collectives).
The save token in data file names keeps a new save at the same location from overwriting files the
published ``.metadata`` still points at, so readers always see the old checkpoint or the new one.

uc_checkpoint adds a manifest of every data file (size in bytes, CRC-32 of the whole file and of each
block, see :mod:`uc_checkpoint.format.integrity`) as the plain-dict attribute ``uc_manifest`` of the
``Metadata`` object. It is inside ``.metadata``, so it is published atomically with it; stock
``FileSystemReader`` ignores it. Shape::

    {"format": 3, "save_id": str, "checksum": "crc32",
     "files": {name: {"size": int, "crc32": "8 hex digits",
                      "block_size": int, "blocks": bytes (big-endian uint32 per block)}},
     "saved_by": {"host": str, "pid": int, "time": unix seconds}}   # since 0.1; optional

Format 1 (written by the first release) has no ``block_size``/``blocks``; it still loads. Format 3
means the ``.metadata`` ends with a checksum trailer over the whole pickle (see
:func:`uc_checkpoint.dcp.metadata_io.dump_metadata`); formats 1 and 2 were written without one.

While a save runs, its location also holds a save marker ``.uc-save-<save token>`` (``__<rank>.``
in front for DCP's rank-local saves; a few bytes of JSON: host, pid, start time), written before any data file and deleted after the publish. Two saves
at one location see each other's markers; the newer one (by the store's modification time) publishes,
the older fails with :class:`~uc_checkpoint.errors.ConcurrentSaveError`. A killed save's marker is
older than any later save, so it never blocks one; ``uc-checkpoint gc`` removes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from uc_checkpoint.format.integrity import FileRecord
from uc_checkpoint.format.manifest import MANIFEST_FORMAT as MANIFEST_FORMAT
from uc_checkpoint.format.manifest import READABLE_FORMATS, Manifest, entries_of
from uc_checkpoint.format.manifest import TRAILER_FORMATS as TRAILER_FORMATS

if TYPE_CHECKING:  # DCP's types, for annotations only: naming files needs no torch
    pass

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
MANIFEST_ATTR = "uc_manifest"
# The manifest's format numbers live with the typed manifest (uc_checkpoint.format.manifest).
_READABLE_FORMATS = READABLE_FORMATS

#: Left by a CheckpointManager in a published checkpoint that a rollback abandoned (JSON; see
#: :mod:`uc_checkpoint.ops.lineage`). It annotates the checkpoint: a save that replaces the checkpoint
#: deletes it, garbage collection never does.
ABANDONED_NAME = ".uc-abandoned"

_RANK_METADATA = re.compile(r"^__\d+\.metadata$")
_TEMP = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")
_SAVE_MARKER = re.compile(r"^(?:__(\d+))?\.uc-save-([0-9a-f]{8,32})$")


def metadata_name(rank: int | None = None) -> str:
    """``.metadata``, or ``__<rank>.metadata`` for DCP's rank-local metadata (no collectives)."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is something a DCP save (ours or stock) puts at a checkpoint location."""
    return (
        name == METADATA_NAME
        or name == METADATA_NAME + ".tmp"  # stock FileSystemWriter's temp file
        or name == ABANDONED_NAME
        or name.endswith(DATA_SUFFIX)
        or bool(_RANK_METADATA.match(name))
        or bool(_TEMP.match(name))
        or bool(_SAVE_MARKER.match(name))
    )


def save_marker_name(save_token: str, rank: int | None = None) -> str:
    """Name of the marker a save keeps at its location while it runs (see the module docstring):
    ``.uc-save-<token>``, or ``__<rank>.uc-save-<token>`` for a rank-local save (no collectives)."""
    return f".uc-save-{save_token}" if rank is None else f"__{rank}.uc-save-{save_token}"


def parse_save_marker(name: str) -> tuple[int | None, str] | None:
    """``(rank or None, save token)`` of a save marker's file name, or None for any other name."""
    m = _SAVE_MARKER.match(name)
    if m is None:
        return None
    return (None if m.group(1) is None else int(m.group(1))), m.group(2)


def data_file_prefix(rank: int, save_token: str) -> str:
    """Prefix of the data files one rank writes in one save."""
    return f"__{rank}_{save_token}_"


def build_manifest(
    save_id: str, records: Iterable[FileRecord], saved_by: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The manifest dict for the files of one save (see the module docstring); ``saved_by``
    (``{"host": str, "pid": int, "time": unix seconds}``) says which process published it.
    :meth:`Manifest.build` then :meth:`Manifest.to_dict`."""
    return Manifest.build(save_id, records, saved_by).to_dict()


def manifest_records(manifest: Mapping[str, Any] | None) -> dict[str, FileRecord]:
    """The manifest's files as :class:`FileRecord` by name (empty without a manifest).

    Raises:
        KeyError / TypeError / ValueError / AttributeError: a record is malformed
            (:func:`uc_checkpoint.format.manifest.entries_of`).
    """
    return {name: entry.to_record() for name, entry in entries_of(manifest).items()}


# Names this module had before the DCP helpers moved to uc_checkpoint.dcp.metadata_io: still found
# here, for one release, without this torch-free module importing DCP unless one is asked for.
_MOVED_TO_METADATA_IO = ("manifest_of", "referenced_files", "data_file_names")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_METADATA_IO:
        import importlib

        return getattr(importlib.import_module("uc_checkpoint.dcp.metadata_io"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
