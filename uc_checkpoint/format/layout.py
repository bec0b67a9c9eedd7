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
     "saved_by": {"host": str, "pid": int, "time": unix seconds,   # since 0.1; optional
                  "mlflow_run_id": str}}                           # optional: the save's MLflow run

Format 1 (written by the first release) has no ``block_size``/``blocks``; it still loads. Format 3
means the ``.metadata`` ends with a checksum trailer over the whole pickle (see
:func:`uc_checkpoint.dcp.metadata_io.dump_metadata`); formats 1 and 2 were written without one.

Spread prefixes (opt-in, or automatic for very large saves on S3; see :func:`spread_count`): an
object store limits the request rate per key prefix (S3: about 3,500 writes/s before ``503
SlowDown``), so a save of thousands of ranks can put each rank's data files one level down, under
``<spread>/``: ``<spread>/__<rank>_<save token>_<n>.distcp``, where ``<spread>`` is the rank modulo
the number of prefixes in lower-case hex, of a fixed width (``0``..``f`` for up to 16 prefixes,
``00``..``ff`` for up to 256). Those characters come right after the checkpoint's own prefix, which is
where the store can split its request capacity. DCP's ``.metadata`` records each file's path
relative to the checkpoint (``_StorageInfo.relative_path``), and stock ``FileSystemReader`` /
``FsspecReader`` join it with the checkpoint's path, so they load such a checkpoint unchanged.
``.metadata``, save markers, the claim and the abandonment marker always stay at the top of the
location.

While a save runs, its location also holds a save marker ``.uc-save-<save token>`` (``__<rank>.``
in front for DCP's rank-local saves; a few bytes of JSON: host, pid, start time), written before any
data file and deleted after the publish: it tells ``uc-checkpoint gc`` and the next save that
multipart uploads there may belong to a save in progress. Right after its marker, a save writes the
location's claim ``.uc-claim`` (``__<rank>.uc-claim`` for a rank-local save; the same JSON with the
save's token), replacing the one an earlier save left: the last save to claim the location is the
only one that may publish there. Before publishing, a save checks that the claim is still its own
(on S3 a HEAD whose ETag is the one its PUT got back; elsewhere by reading the token back). The
claim is the only judge, so two saves at one location always agree on which publishes; the other
fails with :class:`~uc_checkpoint.errors.ConcurrentSaveError`. A killed save's claim is
replaced by the next save, so it never blocks one; ``uc-checkpoint gc`` removes a killed save's
marker, and a claim stays with its location (removed with the checkpoint).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from uc_checkpoint.format.integrity import FileRecord
from uc_checkpoint.format.manifest import Manifest, entries_of

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
MANIFEST_ATTR = "uc_manifest"

#: Left by a CheckpointManager in a published checkpoint that a rollback abandoned (JSON; see
#: :mod:`uc_checkpoint.ops.lineage`). It annotates the checkpoint: a save that replaces the checkpoint
#: deletes it, garbage collection never does.
ABANDONED_NAME = ".uc-abandoned"

#: Most prefixes a checkpoint's data files may be spread over (two hex digits).
MAX_SPREAD_PREFIXES = 256
#: Automatic spreading (``spread_prefixes=None``) starts at this many ranks, on stores that
#: partition request capacity by key prefix (S3)...
AUTO_SPREAD_MIN_RANKS = 256
#: ... with one prefix per this many ranks (8 prefixes at 256 ranks, 256 from 8,192 ranks on).
AUTO_RANKS_PER_PREFIX = 32

#: The names of a root's step locations start with this (:func:`checkpoint_name`).
STEP_PREFIX = "step_"

_STEP_DIR = re.compile(r"^step_(\d+)/?$")
_RANK_METADATA = re.compile(r"^__\d+\.metadata$")
_SPREAD_DIR = re.compile(r"^[0-9a-f]{1,2}/$")
_TEMP = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")
_SAVE_MARKER = re.compile(r"^(?:__(\d+))?\.uc-save-([0-9a-f]{8,32})$")
_CLAIM = re.compile(r"^(?:__\d+)?\.uc-claim$")


def checkpoint_name(step: int) -> str:
    """The location name of the checkpoint of ``step`` under a root: ``step_00000042``.

    Raises:
        ValueError: ``step`` is negative.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a location named as :func:`checkpoint_name` names them (a trailing ``/``, as
    listings show sub-locations, allowed), or None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def spread_count(option: int | None, world_size: int, *, partitioned_store: bool) -> int:
    """How many key prefixes a save of ``world_size`` ranks spreads its data files over (1: none,
    the flat layout).

    Args:
        option: the writer's ``spread_prefixes``: an explicit count (1 = flat), or None for
            automatic: flat below :data:`AUTO_SPREAD_MIN_RANKS` ranks or on a store that does not
            partition request capacity by prefix (``partitioned_store`` False: local and FUSE
            paths, fsspec URLs), else one prefix per :data:`AUTO_RANKS_PER_PREFIX` ranks, at most
            :data:`MAX_SPREAD_PREFIXES`.
        world_size: ranks in the save.

    Raises:
        ValueError: ``option`` is below 1 or above :data:`MAX_SPREAD_PREFIXES`.
    """
    if option is not None:
        if not 1 <= option <= MAX_SPREAD_PREFIXES:
            raise ValueError(f"spread_prefixes must be None or 1..{MAX_SPREAD_PREFIXES}, got {option}")
        return option
    if not partitioned_store or world_size < AUTO_SPREAD_MIN_RANKS:
        return 1
    return min(MAX_SPREAD_PREFIXES, -(-world_size // AUTO_RANKS_PER_PREFIX))


def spread_dir(rank: int, prefixes: int) -> str:
    """The sub-location (no trailing ``/``) of ``rank``'s data files when a save spreads them over
    ``prefixes`` key prefixes: ``rank % prefixes`` in lower-case hex, as wide as ``prefixes - 1``
    is (so ``prefixes=16`` gives ``0``..``f``, ``prefixes=32`` gives ``00``..``1f``); ``""`` for
    ``prefixes <= 1`` (the flat layout)."""
    if prefixes <= 1:
        return ""
    width = len(f"{prefixes - 1:x}")
    return f"{rank % prefixes:0{width}x}"


def is_spread_dir(name: str) -> bool:
    """Whether a listing's entry ``name`` (a sub-location's ends with ``/``) is one of the
    sub-locations :func:`spread_dir` names."""
    return bool(_SPREAD_DIR.match(name))


def split_spread(name: str) -> tuple[str, str]:
    """``(spread dir, file name)`` of a data file's name relative to the checkpoint
    (``("3a", "__5_..distcp")``, or ``("", name)`` for a file at the top of the location)."""
    head, sep, tail = name.rpartition("/")
    return (head, tail) if sep else ("", name)


def metadata_name(rank: int | None = None) -> str:
    """``.metadata``, or ``__<rank>.metadata`` for DCP's rank-local metadata (no collectives)."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is something a DCP save (ours or stock) puts at a checkpoint location: a
    file at its top, or a data file in a spread prefix (``3a/__5_<token>_0.distcp``)."""
    if "/" in name:
        head, sep, tail = name.partition("/")
        return is_spread_dir(head + sep) and "/" not in tail and tail.endswith(DATA_SUFFIX)
    return (
        name == METADATA_NAME
        or name == METADATA_NAME + ".tmp"  # stock FileSystemWriter's temp file
        or name == ABANDONED_NAME
        or name.endswith(DATA_SUFFIX)
        or bool(_RANK_METADATA.match(name))
        or bool(_TEMP.match(name))
        or bool(_SAVE_MARKER.match(name))
        or bool(_CLAIM.match(name))
    )


def claim_name(rank: int | None = None) -> str:
    """Name of a location's claim (see the module docstring): ``.uc-claim``, or
    ``__<rank>.uc-claim`` for a rank-local save (no collectives)."""
    return ".uc-claim" if rank is None else f"__{rank}.uc-claim"


def is_claim(name: str) -> bool:
    """Whether ``name`` is a location's claim (of the collective save or of one rank's)."""
    return bool(_CLAIM.match(name))


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


def data_file_prefix(rank: int, save_token: str, spread: str = "") -> str:
    """Prefix of the data files one rank writes in one save, relative to the checkpoint:
    ``__<rank>_<token>_``, or ``<spread>/__<rank>_<token>_`` in a spread prefix (:func:`spread_dir`)."""
    return f"{spread}/__{rank}_{save_token}_" if spread else f"__{rank}_{save_token}_"


def is_data_file_of(name: str, save_token: str) -> bool:
    """Whether ``name`` (relative to the checkpoint, spread prefix included) is a data file of the
    save whose token is ``save_token``, on any rank."""
    return bool(re.fullmatch(rf"__\d+_{re.escape(save_token)}_\d+\{DATA_SUFFIX}", split_spread(name)[1]))


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
