"""What is under a checkpoint root and inside one checkpoint, without loading tensors: the
``uc-checkpoint ls`` and ``inspect`` verbs. What a location holds and whether it is intact is
:mod:`uc_checkpoint.ops.catalog`'s, shared with ``CheckpointManager.latest()``. Works on every
volume kind (local/FUSE paths, ``s3://``, fsspec URLs).

``ls`` reads the ``.metadata`` of each checkpoint it checks without torch (the catalog peeks at
it: :func:`uc_checkpoint.format.metadata_peek.peek_metadata`), so it never imports torch; only
``inspect``, which decodes a ``.metadata`` in full and loads the data-pipeline state, does."""

from __future__ import annotations

import json
import logging
import re
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from uc_checkpoint.engine.listing import checkpoint_files
from uc_checkpoint.errors import one_line
from uc_checkpoint.format.layout import split_spread
from uc_checkpoint.format.manifest import entries_of
from uc_checkpoint.ops import catalog
from uc_checkpoint.ops.catalog import file_problems, missing_or_short
from uc_checkpoint.volumes import Volume, open_volume

logger = logging.getLogger(__name__)

_RANK_OF_FILE = re.compile(r"^__(\d+)_")


@dataclass
class CheckpointSummary:
    """One step location under a root, as ``uc-checkpoint ls`` shows it.

    Attributes:
        step: the training step (from the ``step_NNNNNNNN`` name).
        name: the location's name under the root.
        location: its full path or URL.
        state: ``"complete"`` (published, every data file there with its size), ``"incomplete"``
            (no ``.metadata``: a save in progress or one that failed), ``"broken"`` (published but
            a file is missing, short or the metadata unreadable; see ``problem``),
            ``"abandoned"`` (complete, but on a branch a rollback left: ``latest()`` skips it; see
            :mod:`uc_checkpoint.ops.lineage`) or ``"published"`` (a ``.metadata`` is there, but
            the checkpoint was not checked: see :func:`list_root`'s ``check``).
        bytes: size of the checkpoint's own files, in bytes: for a checked published checkpoint
            whose ``.metadata`` decodes, that ``.metadata``, its rollback marker if any and the data
            files it references (as ``inspect`` counts them); for an unchecked one every file a save
            writes there but the claim (a failed later save's leftovers included); otherwise every
            file at the location.
        files: number of data files counted in ``bytes``.
        age_s: seconds since the newest of those files was written (None when the store has no times).
        problem: what is wrong with a broken checkpoint (or which rollback abandoned it), else None.
        unreferenced_files: files a save writes that lie at a published checkpoint's location but
            that its ``.metadata`` does not reference (a killed later save's leftovers, removed by
            ``uc-checkpoint gc`` once old, or a save in progress there); 0 where none or not known
            (a checkpoint not checked).
        unreferenced_bytes: their total size in bytes.
    """

    step: int
    name: str
    location: str
    state: str
    bytes: int
    files: int
    age_s: float | None
    problem: str | None = None
    unreferenced_files: int = 0
    unreferenced_bytes: int = 0


def list_root(root: str | Volume, *, check: str = "latest") -> list[CheckpointSummary]:
    """Every step location under ``root``, oldest first (what ``uc-checkpoint ls`` prints).

    Args:
        root: the checkpoint root: a path, URL or volume.
        check: which published checkpoints are checked (their ``.metadata`` read and their files
            compared with it; :func:`uc_checkpoint.ops.catalog.scan`): ``"latest"`` (default) the
            newest until one is complete, the one ``CheckpointManager.latest()`` resumes from, so
            every newer one shows whether it is broken or abandoned and every older one is
            ``"published"``; ``"all"`` every one; ``"none"`` none (nothing but the listing read).

    Requests: the root's recursive listing (S3: one per 1,000 keys under the root), plus one
    ``.metadata`` GET per checkpoint checked: one, usually, with ``"latest"``; one per published
    checkpoint, a few at a time, with ``"all"``.

    A checkpoint is ``"broken"`` only on evidence of damage (a missing or short file, an
    undecodable or unsafe ``.metadata``); a store that fails to answer is an error, never a state.

    Raises:
        ValueError: ``check`` is not ``"none"``, ``"latest"`` or ``"all"``.
        VolumeError: a local root is missing or not a directory.
        VolumeError / TransferError: the root or a ``.metadata`` cannot be read (the store's client
            has retried already).
    """
    volume = catalog.open_root(root)
    return [
        CheckpointSummary(
            step=info.step,
            name=info.name,
            location=volume.child(info.name).url,
            state=info.state or ("published" if info.published else "incomplete"),
            bytes=info.bytes or 0,
            files=info.files or 0,
            age_s=info.age_s,
            # An unpublished location has no problem to show, even one unpublished while listed.
            problem=info.problem if info.state in ("broken", "abandoned") else None,
            unreferenced_files=info.unreferenced_files or 0,
            unreferenced_bytes=info.unreferenced_bytes or 0,
        )
        for info in catalog.scan(volume, check=check)
    ]


def describe_checkpoint(location: str | Volume, *, data_state: bool = True) -> dict[str, Any]:
    """The contents of one published checkpoint, from its ``.metadata`` (and, with ``data_state``,
    the data-pipeline state item, which is read from its data file).

    Returns ``{"location", "save_id", "saved_by", "items": [{"key", "kind": "tensor"|"bytes",
    "dtype", "shape", "bytes", "chunks"}], "files": {rank: [{"name", "bytes"}]}, "total_bytes",
    "data_pipeline": {key: state dict} }`` (JSON-serialisable).

    Raises:
        CheckpointNotFoundError: nothing is published at ``location``.
        CorruptCheckpointError: the ``.metadata`` is unreadable or unsafe.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from uc_checkpoint.dcp.metadata_io import manifest_of, read_metadata, referenced_files

    volume = location if isinstance(location, Volume) else open_volume(location)
    metadata = read_metadata(volume)
    items = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for d in md.size:
                numel *= d
            itemsize = md.properties.dtype.itemsize if hasattr(md.properties.dtype, "itemsize") else 0
            items.append(
                {
                    "key": key,
                    "kind": "tensor",
                    "dtype": str(md.properties.dtype).replace("torch.", ""),
                    "shape": list(md.size),
                    "bytes": numel * itemsize,
                    "chunks": len(md.chunks),
                }
            )
        elif isinstance(md, BytesStorageMetadata):
            items.append({"key": key, "kind": "bytes", "dtype": None, "shape": None, "bytes": None, "chunks": 1})
    manifest = manifest_of(metadata) or {}
    sizes = {name: entry.size for name, entry in entries_of(manifest).items()}
    if not sizes:  # stock FileSystemWriter checkpoints carry no manifest: list the files instead
        listing = checkpoint_files(volume)
        sizes = {name: listing.get(name, -1) for name in referenced_files(metadata)}
    files: dict[str, list[dict[str, Any]]] = {}
    for name in sorted(sizes):
        m = _RANK_OF_FILE.match(split_spread(name)[1])
        files.setdefault(m.group(1) if m else "?", []).append({"name": name, "bytes": sizes[name]})
    out: dict[str, Any] = {
        "location": volume.url,
        "save_id": manifest.get("save_id"),
        "saved_by": manifest.get("saved_by"),
        "items": items,
        "files": files,
        "total_bytes": sum(s for s in sizes.values() if s > 0),
    }
    if data_state:
        out["data_pipeline"] = _data_pipeline_states(volume, items)
    return out


def _data_pipeline_states(volume: Volume, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The data tracker's saved states (``TrackerStateful`` stores ``<key>.global_state``, a JSON
    text), summarised; an unreadable one is reported, not raised."""
    import torch.distributed.checkpoint as dcp

    from uc_checkpoint.dcp.reader import UCVolumeReader

    keys = [i["key"] for i in items if i["kind"] == "bytes" and i["key"].endswith("global_state")]
    out: dict[str, Any] = {}
    for key in keys:
        target: dict[str, Any] = {key: None}
        try:
            with warnings.catch_warnings():  # "torch.distributed is disabled ...": a one-process read, as meant
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(target, storage_reader=UCVolumeReader(volume), no_dist=True)
            state = json.loads(target[key])
            remaining = sum(end - start for _shard, start, end in state.get("remaining", []))
            out[key] = {
                "epoch": state.get("epoch"),
                "seed": state.get("seed"),
                "shuffle_within_shard": state.get("shuffle_within_shard"),
                "samples_consumed_in_epoch": state.get("samples_consumed_in_epoch"),
                "samples_remaining_in_epoch": remaining,
                "num_shards": state.get("num_shards"),
                "shards_with_remaining_work": len({s for s, _a, _b in state.get("remaining", [])}),
                "fingerprint": state.get("fingerprint"),
                "exactly_once": _digest_summary(state),
            }
        except BaseException as exc:  # noqa: BLE001 - DCP wraps errors in a BaseException; inspect reports them
            out[key] = {"error": one_line(exc)}  # the rank's own error, e.g. the missing file
    return out


def _digest_summary(state: Any) -> dict[str, Any]:
    """The exactly-once digest of a saved tracker state, checked so far (every sample counted as
    consumed consumed once; hashes the dataset once): ``{"samples_covered", "shards_complete",
    "shards", "checks_out": bool | None, "problem": str | None}``, ``checks_out`` None when the
    state cannot be checked (``problem`` says why)."""
    from uc_checkpoint.data.state import TrackerState
    from uc_checkpoint.errors import TrackerStateError

    out: dict[str, Any] = {"samples_covered": None, "shards_complete": None, "shards": None, "checks_out": None}
    try:
        parsed = TrackerState.from_dict(state)
    except TrackerStateError as exc:
        return {**out, "problem": one_line(exc)}
    if parsed.digest is None:
        return {**out, "problem": "no digest (saved with exactly_once='off', or the dataset changed in this epoch)"}
    out["samples_covered"] = parsed.digest.count()
    report = parsed.check_digest()
    if report is None:
        return {**out, "problem": "saved without the shard list, whose names the digest is keyed by"}
    return {
        **out,
        "shards_complete": report.shards_complete,
        "shards": report.shards,
        "checks_out": report.ok,
        "problem": None if report.ok else report.describe(),
    }


def summary_dict(s: CheckpointSummary) -> dict[str, Any]:
    """A :class:`CheckpointSummary` as a JSON-serialisable dict."""
    return asdict(s)


__all__ = ["CheckpointSummary", "describe_checkpoint", "file_problems", "list_root", "missing_or_short", "summary_dict"]
