"""Export a DCP checkpoint's tensors for serving: full tensors in safetensors or ``torch.save``
files, on any volume, published atomically (``uc-checkpoint export``).

A checkpoint saved by N ranks holds each tensor as chunks (DTensor / FSDP shards) spread over the
ranks' data files. The export plans its output files from ``.metadata`` alone (names, shapes,
dtypes), then for one output file at a time has DCP reassemble that file's tensors: ``dcp.load``
with ``no_dist=True`` into full-size empty tensors, through :class:`~uc_checkpoint.dcp.reader.
UCVolumeReader` fetching byte ranges (DCP's resharding reads every chunk that overlaps each full
tensor; the idea is ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``'s, cut into
bounded pieces). Each file is encoded into local staging, uploaded through the
:class:`~uc_checkpoint.volumes.Volume` API (which checks what landed) and dropped from memory
before the next one is read.

Memory bound: the tensors of one output file as stored in the checkpoint (at most
``max_shard_bytes`` of output, or the one tensor larger than that; more by the ratio of itemsizes
when ``dtype`` narrows them), with ``dtype`` the same tensors once more at the export dtype, plus
the reader's in-flight ranges (``max_inflight_bytes``, 256 MiB by default). A one-file export reads
its encoded file back into memory to publish it in one atomic write, after its tensors are freed.
Measured: docs/export.md, "Memory".

Atomicity: shards are written under names that carry the export's id and that no loader opens
without the index; the index (or the one file) is published last, in one atomic write, after every
shard landed with its size checked. A killed export leaves no index and no ``model.safetensors`` /
``pytorch_model.bin``. Details and the replace order: docs/export.md, "Atomic publish".
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from uc_checkpoint.dcp.options import ReaderOptions
from uc_checkpoint.dcp.reader import UCVolumeReader
from uc_checkpoint.engine.publish import check_data_files, publish_metadata, remove_superseded
from uc_checkpoint.engine.staging_dir import create_staging_dir, staging_dir_for
from uc_checkpoint.errors import CheckpointExistsError, TransferError, VolumeError
from uc_checkpoint.ops.export_formats import ExportFormat, export_format, files_of_index, index_bytes
from uc_checkpoint.volumes import LocalVolume, Volume, open_volume

logger = logging.getLogger(__name__)

#: Hugging Face's default shard size (``save_pretrained(max_shard_size="5GB")``), in bytes.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})

#: Progress callback: ``(tensor bytes exported so far, tensor bytes in all)``.
Progress = Callable[[int, int], None]


def parse_size(text: str | int) -> int:
    """Bytes of a size written as ``2GiB``, ``500MB``, ``5GB``, ``1048576`` (decimal units KB, MB,
    GB, TB; binary KiB, MiB, GiB, TiB; case-insensitive; fractions allowed: ``1.5GiB``).

    Raises:
        ValueError: not a size, or not at least 1 byte; the message quotes it.
    """
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise ValueError(f"not a size: {text!r} (write e.g. 2GiB, 500MB or a number of bytes)")
        value = int(float(match.group(1)) * unit)
    if value < 1:
        raise ValueError(f"a shard size must be at least 1 byte, got {text!r}")
    return value


@dataclass(frozen=True)
class TensorExport:
    """One tensor of an export.

    Attributes:
        fqn: its key in the checkpoint (DCP's flattened name, ``model.layers.0.weight``).
        name: its name in the export (``--key`` and ``--strip-prefix`` applied).
        shape: the full tensor's shape.
        stored_dtype: its dtype in the checkpoint.
        dtype: its dtype in the export.
    """

    fqn: str
    name: str
    shape: tuple[int, ...]
    stored_dtype: torch.dtype
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        """Bytes in the export."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ExportPlan:
    """What :func:`plan_export` chose: the output files' tensors, in checkpoint order, and the items
    left out (non-tensor items: bytes, ints, strings; their keys)."""

    shards: list[list[TensorExport]]
    skipped: list[str]

    @property
    def tensors(self) -> list[TensorExport]:
        return [t for shard in self.shards for t in shard]


@dataclass
class ExportSummary:
    """The outcome of :func:`export_checkpoint`.

    Attributes:
        checkpoint: the checkpoint's URL or path.
        destination: the export's URL or path.
        format: ``safetensors`` or ``torch``.
        export_id: this export's id (8 hex digits, in its shards' names).
        entry: the file a loader opens: the index, or the one file.
        files: every file written, the entry last.
        bytes: bytes of the files written.
        tensors: tensors exported.
        tensor_bytes: their bytes (the index's ``total_size``).
        dtype: the dtype asked for (floating-point tensors converted to it), None: kept.
        dtypes: output dtype name -> number of tensors.
        skipped: keys of the checkpoint's non-tensor items, not exported.
        replaced: whether an earlier export at the destination was replaced.
        removed: files deleted after the publish (the replaced export's, and shards killed
            exports left).
        seconds: wall time of the export.
    """

    checkpoint: str
    destination: str
    format: str
    export_id: str
    entry: str = ""
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    tensors: int = 0
    tensor_bytes: int = 0
    dtype: str | None = None
    dtypes: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    replaced: bool = False
    removed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-able values (``--json``)."""
        return asdict(self)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        found = dtype
    else:
        found = getattr(torch, str(dtype), None)
    if dtype is not None and not (isinstance(found, torch.dtype) and found.is_floating_point):
        raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype (e.g. bfloat16, float16, float32)")
    return found


def plan_export(
    metadata: Metadata,
    *,
    key: str | None = None,
    strip_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    where: str = "the checkpoint",
) -> ExportPlan:
    """Choose the export's tensors, their names and dtypes, and cut them into output files, from a
    checkpoint's ``.metadata`` alone.

    Names: with ``key``, only the items under it (DCP flattens ``{"model": {"w": t}}`` to
    ``model.w``) and named as in that sub-dict (``w``); then ``strip_prefix`` is removed from every
    name that starts with it. ``dtype`` applies to floating-point tensors only (integer and bool
    tensors keep theirs). Files: tensors in checkpoint order, a new file when the next tensor would
    take the current one past ``max_shard_bytes`` (a larger tensor gets a file of its own), as
    Hugging Face's ``save_pretrained`` cuts shards.

    Raises:
        ValueError: ``key`` selects nothing or is a tensor itself (the message lists the top-level
            keys), a name becomes empty or two tensors get the same name (both keys named), there
            is no tensor to export, or ``dtype`` is not a floating-point dtype.
    """
    out_dtype = _dtype(dtype)
    items = metadata.state_dict_metadata
    prefix = f"{key}." if key else ""
    if key and key in items:
        raise ValueError(f"key {key!r} of {where} is a single item, not a dict of tensors; leave out --key")
    if key and not any(fqn.startswith(prefix) for fqn in items):
        tops = sorted({fqn.split(".", 1)[0] for fqn in items})
        raise ValueError(f"key {key!r}: no item of {where} is under it; its top-level keys are {tops}")
    chosen: list[TensorExport] = []
    skipped: list[str] = []
    names: dict[str, str] = {}
    for fqn, md in items.items():
        if not fqn.startswith(prefix):
            continue
        if not isinstance(md, TensorStorageMetadata):
            skipped.append(fqn)
            continue
        name = fqn[len(prefix) :]
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        if not name:
            raise ValueError(f"item {fqn!r} of {where} has no name left once its prefix is removed")
        if name in names:
            raise ValueError(f"items {names[name]!r} and {fqn!r} of {where} would both be exported as {name!r}")
        names[name] = fqn
        stored = md.properties.dtype
        target = out_dtype if out_dtype is not None and stored.is_floating_point else stored
        chosen.append(TensorExport(fqn, name, tuple(md.size), stored, target))
    if not chosen:
        raise ValueError(f"{where} has no tensor{f' under key {key!r}' if key else ''} to export")
    shards: list[list[TensorExport]] = []
    size = 0
    for tensor in chosen:
        if not shards or (shards[-1] and size + tensor.nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return ExportPlan(shards, skipped)


#: Alignment (bytes) of each tensor in a shard's buffer: a multiple of every dtype's itemsize.
_ALIGN = 64


def _views(shard: list[TensorExport], stored: bool) -> dict[str, torch.Tensor]:
    """Empty tensors for ``shard`` (keyed by checkpoint key, at the stored dtype, with ``stored``;
    else by export name at the export dtype), the tensors of each dtype views of one buffer, its
    padding zeroed (``torch.save`` writes whole buffers, and refuses one buffer viewed as two
    dtypes). A few allocations per shard rather than one per tensor: the C allocator returns an
    allocation that large to the system when it is freed, where freed tensor-sized blocks may stay
    in its heap and the process would keep growing shard by shard."""
    groups: dict[torch.dtype, list[tuple[TensorExport, int]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for t in shard:
        dtype = t.stored_dtype if stored else t.dtype
        offset = sizes.get(dtype, 0)
        groups.setdefault(dtype, []).append((t, offset))
        sizes[dtype] = offset + -(-(t.numel * dtype.itemsize) // _ALIGN) * _ALIGN
    out: dict[str, torch.Tensor] = {}
    for dtype, members in groups.items():
        buffer = torch.empty(max(sizes[dtype], 1), dtype=torch.uint8)
        end = 0
        for t, start in members:
            buffer[end:start].zero_()
            end = start + t.numel * dtype.itemsize
            out[t.fqn if stored else t.name] = buffer[start:end].view(dtype).view(t.shape)
        buffer[end:].zero_()
    return out


def _load_shard(reader: UCVolumeReader, shard: list[TensorExport]) -> dict[str, torch.Tensor]:
    """The shard's full tensors, reassembled by DCP from the checkpoint's chunks, named as
    exported and converted to the export's dtypes (into a second buffer, then the first is freed)."""
    state = _views(shard, stored=True)
    with warnings.catch_warnings():
        # DCP warns that it assumes one process when no process group exists: that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    if all(t.dtype == t.stored_dtype for t in shard):
        return {t.name: state[t.fqn] for t in shard}
    out = _views(shard, stored=False)
    for t in shard:
        out[t.name].copy_(state.pop(t.fqn))
    return out


def _existing(
    volume: Volume, fmt: ExportFormat, listing: Mapping[str, int]
) -> tuple[dict[str, bytes | None], set[str]]:
    """The export of this format at the destination: ``({entry name: its bytes if an index}, the
    shard files its index names)``."""
    entries: dict[str, bytes | None] = {}
    shards: set[str] = set()
    if fmt.single in listing:
        entries[fmt.single] = None
    if fmt.index in listing:
        raw = volume.read_bytes(fmt.index)
        entries[fmt.index] = raw
        named = files_of_index(raw)
        if named is None:
            logger.warning("%s is not an index; it is replaced, and no shard of it deleted", volume.url_of(fmt.index))
        shards |= named or set()
    return entries, shards


def _check_apart(checkpoint: Volume, dest: Volume) -> None:
    """Refuse an export whose destination is the checkpoint, lies inside it, or holds it: the
    export would write among the checkpoint's files, or list them as its own. Local locations are
    compared by their real paths (symlinks resolved: a link that reaches the checkpoint is inside
    it); other volumes by their URLs.

    Raises:
        VolumeError: naming both locations (and the real paths, where a link led there).
    """
    given = ckpt_at, dest_at = checkpoint.url.rstrip("/"), dest.url.rstrip("/")
    if isinstance(checkpoint, LocalVolume) and isinstance(dest, LocalVolume):
        ckpt_at, dest_at = os.path.realpath(checkpoint.root), os.path.realpath(dest.root)
    resolved = "" if (ckpt_at, dest_at) == given else f" (real paths {dest_at} and {ckpt_at})"
    if (dest_at.rstrip("/") + "/").startswith(ckpt_at.rstrip("/") + "/"):
        raise VolumeError(
            f"export destination {dest.url} is inside the checkpoint {checkpoint.url}{resolved}: "
            "choose a location outside it"
        )
    if (ckpt_at.rstrip("/") + "/").startswith(dest_at.rstrip("/") + "/"):
        raise VolumeError(
            f"the checkpoint {checkpoint.url} is inside the export destination {dest.url}{resolved}: "
            "choose a location that does not hold the checkpoint"
        )
    if isinstance(checkpoint, LocalVolume) and isinstance(dest, LocalVolume):
        # A second mount of the same directory (mount --bind, a NFS path beside the local one) has
        # other real paths but the same device and inode numbers.
        if _within_by_identity(Path(dest_at), Path(ckpt_at)):
            raise VolumeError(
                f"export destination {dest.url} is the checkpoint {checkpoint.url} or inside it, reached "
                "through another mount of the same directory: choose a location outside it"
            )
        if _within_by_identity(Path(ckpt_at), Path(dest_at)):
            raise VolumeError(
                f"the checkpoint {checkpoint.url} is inside the export destination {dest.url}, reached "
                "through another mount of the same directory: choose a location that does not hold it"
            )


def _within_by_identity(path: Path, container: Path) -> bool:
    """Whether ``path`` (or its nearest existing ancestor) is ``container`` or lies under it, by
    device and inode numbers, which a bind mount or a second mount of one directory keeps."""
    try:
        target = os.stat(container)
    except OSError:
        return False
    for at in (path, *path.parents):
        try:
            st = os.stat(at)
        except OSError:
            continue  # not created yet: its ancestors decide
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def export_checkpoint(
    checkpoint: str | os.PathLike[str] | Volume,
    dest: str | Volume,
    *,
    format: str,
    key: str | None = None,
    strip_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    volume_options: dict[str, Any] | None = None,
    staging_dir: str | Path | None = None,
    progress: Progress | None = None,
) -> ExportSummary:
    """Write the full tensors of ``checkpoint`` to ``dest`` in ``format``, one output file in memory
    at a time, and publish the export atomically.

    Args:
        checkpoint: the checkpoint's location (path, ``s3://``, fsspec URL) or a
            :class:`~uc_checkpoint.volumes.Volume`; read with :class:`UCVolumeReader`.
        dest: the export's location or volume; a directory of files as Hugging Face lays them out
            (:mod:`uc_checkpoint.ops.export_formats`). Other files there (``config.json``) are left
            alone.
        format: ``"safetensors"`` or ``"torch"``.
        key, strip_prefix, dtype, max_shard_bytes: what to export and how it is cut
            (:func:`plan_export`); ``max_shard_bytes`` in bytes.
        overwrite: replace an export of this format at ``dest``; without it, one there is refused.
        volume_options: options for ``dest``'s volume (:func:`~uc_checkpoint.volumes.open_volume`).
        staging_dir: local root for the files being written (default as for saves:
            ``$UC_CHECKPOINT_STAGING_DIR`` or the temp dir); emptied when the export ends.
        progress: called with ``(bytes done, bytes in all)`` of tensor data after each file.

    Memory: see the module docstring; measured in docs/export.md, "Memory".

    Returns:
        An :class:`ExportSummary`.

    Raises:
        CheckpointNotFoundError: ``checkpoint`` has no ``.metadata``.
        CorruptCheckpointError: the checkpoint's files are missing, truncated or damaged (named).
        CheckpointExistsError: an export of this format is at ``dest`` and ``overwrite`` is false,
            or one appeared while this one ran.
        VolumeError: ``dest`` is the checkpoint, inside it or holds it (through a symlink too).
        ValueError: see :func:`plan_export`; a dtype the format cannot hold; an unknown format.
        UCCheckpointError: ``safetensors`` is asked for and the package is missing.
        TransferError / VolumeError: ``dest`` cannot be written, or a file landed with another size.
    """
    started = time.monotonic()
    fmt = export_format(format)
    reader = UCVolumeReader(checkpoint, options=ReaderOptions(prefetch_files=False))
    source = reader.volume.url
    metadata = reader.load_metadata()
    plan = plan_export(
        metadata, key=key, strip_prefix=strip_prefix, dtype=dtype, max_shard_bytes=max_shard_bytes, where=source
    )
    fmt.check_dtypes({t.dtype for t in plan.tensors})
    volume = open_volume(dest, **(volume_options or {}))
    _check_apart(reader.volume, volume)
    try:
        volume.prepare_for_write(create_parents=True)
    except VolumeError as exc:
        raise VolumeError(f"export destination: {exc}") from exc
    listing = volume.list_files()
    old_entries, old_shards = _existing(volume, fmt, listing)
    if old_entries and not overwrite:
        name = next(iter(old_entries))
        raise CheckpointExistsError(
            f"{volume.url_of(name)} exists: an export is there already; overwrite=True (--overwrite) replaces it"
        )
    export_id = uuid.uuid4().hex[:8]
    summary = ExportSummary(source, volume.url, fmt.name, export_id, replaced=bool(old_entries))
    summary.dtype = None if dtype is None else str(_dtype(dtype)).removeprefix("torch.")
    summary.skipped = plan.skipped
    for t in plan.tensors:
        label = str(t.dtype).removeprefix("torch.")
        summary.dtypes[label] = summary.dtypes.get(label, 0) + 1
    summary.tensors = len(plan.tensors)
    summary.tensor_bytes = sum(t.nbytes for t in plan.tensors)
    if plan.skipped:
        logger.info("not exported (not tensors): %s", ", ".join(plan.skipped))
    held = create_staging_dir(staging_dir_for(staging_dir, "export", volume.url, export_id, 0))
    stage = held.path
    try:
        if len(plan.shards) == 1:
            _write_single(
                reader, volume, fmt, plan, stage, summary, overwrite=fmt.single in old_entries, progress=progress
            )
        else:
            _write_sharded(
                reader, volume, fmt, plan, stage, summary, old_index=old_entries.get(fmt.index), progress=progress
            )
    finally:
        held.remove()
    # The new export is published. What the old one had, and what killed exports left, goes now:
    # its other entry first (no entry may name a missing shard), then shards nothing names.
    kept = set(summary.files)
    stale_entries = [name for name in fmt.entries() if name in old_entries and name not in kept]
    stale_shards = sorted(
        name for name in (old_shards | {n for n in listing if fmt.is_shard_name(n)}) if name not in kept
    )
    remove_superseded(volume, stale_entries)
    remove_superseded(volume, stale_shards)
    summary.removed = stale_entries + stale_shards
    summary.seconds = time.monotonic() - started
    logger.info(
        "exported %d tensor%s (%d bytes) of %s to %s in %d file%s (%.1f s)",
        summary.tensors,
        "" if summary.tensors == 1 else "s",
        summary.tensor_bytes,
        source,
        volume.url,
        len(summary.files),
        "" if len(summary.files) == 1 else "s",
        summary.seconds,
    )
    return summary


def _write_single(
    reader: UCVolumeReader,
    volume: Volume,
    fmt: ExportFormat,
    plan: ExportPlan,
    stage: Path,
    summary: ExportSummary,
    *,
    overwrite: bool,
    progress: Progress | None,
) -> None:
    """One file: encoded into staging, its tensors freed, then published under its final name in
    one atomic write (:meth:`Volume.publish_bytes`; the volume checks what landed)."""
    (shard,) = plan.shards
    path = stage / fmt.single
    tensors = _load_shard(reader, shard)
    fmt.write(tensors, path)
    del tensors
    data = path.read_bytes()
    path.unlink()
    volume.publish_bytes(fmt.single, data, overwrite=overwrite)
    landed = volume.size(fmt.single)
    if landed != len(data):
        raise TransferError(f"{volume.url_of(fmt.single)} landed with {landed} bytes, expected {len(data)}")
    summary.entry = fmt.single
    summary.files = [fmt.single]
    summary.bytes = len(data)
    if progress is not None:
        progress(summary.tensor_bytes, summary.tensor_bytes)


def _write_sharded(
    reader: UCVolumeReader,
    volume: Volume,
    fmt: ExportFormat,
    plan: ExportPlan,
    stage: Path,
    summary: ExportSummary,
    *,
    old_index: bytes | None,
    progress: Progress | None,
) -> None:
    """Shards one by one (read, encode into staging, upload with its size checked, dropped), then
    the index, published only once every shard is on the volume."""
    count = len(plan.shards)
    weight_map: dict[str, str] = {}
    sizes: dict[str, int] = {}
    done = 0
    for number, shard in enumerate(plan.shards, start=1):
        name = fmt.shard_name(number, count, summary.export_id)
        path = stage / name
        tensors = _load_shard(reader, shard)
        fmt.write(tensors, path)
        del tensors
        record = volume.upload_file(path, name)
        path.unlink()
        sizes[name] = record.size
        weight_map.update({t.name: name for t in shard})
        done += sum(t.nbytes for t in shard)
        logger.info("uploaded %s (%d bytes, %d tensors)", volume.url_of(name), record.size, len(shard))
        if progress is not None:
            progress(done, summary.tensor_bytes)
    # A volume that cannot vouch for its uploads is listed once: every shard there, whole.
    check_data_files(volume, None if volume.verifies_uploads else volume.list_files(), sizes, sizes)
    extra = {"export_id": summary.export_id, "checkpoint": summary.checkpoint}
    blob = index_bytes(weight_map, summary.tensor_bytes, extra)
    publish_metadata(
        volume, fmt.index, blob, overwrite=old_index is not None, read_manifest=lambda _raw: None, replaced=old_index
    )
    summary.entry = fmt.index
    summary.files = [*sizes, fmt.index]
    summary.bytes = sum(sizes.values()) + len(blob)


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "ExportPlan",
    "ExportSummary",
    "TensorExport",
    "export_checkpoint",
    "parse_size",
    "plan_export",
]
