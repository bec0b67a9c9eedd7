"""The files an export writes: names, encoders and the Hugging Face index, for
:mod:`uc_checkpoint.ops.export`.

Two formats, both laid out as Hugging Face's ``save_pretrained`` lays them out, so that
``transformers``, ``safetensors`` and ``torch.load`` take them as they are:

========================  ==============================  ==========================================
format                    one file                        several files (shards)
========================  ==============================  ==========================================
``safetensors``           ``model.safetensors``           ``model-00001-of-00003-<id>.safetensors``
                                                          and ``model.safetensors.index.json``
``torch``                 ``pytorch_model.bin``           ``pytorch_model-00001-of-00003-<id>.bin``
                                                          and ``pytorch_model.bin.index.json``
========================  ==============================  ==========================================

``<id>`` is the export's own id (8 hex digits): shards of two exports to one destination never
share a name, so an export replacing another leaves the old one whole until its own index replaces
the old index (see docs/export.md, "Atomic publish"). The index is Hugging Face's
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), which loaders read to find the
shards.

Encoders: the ``safetensors`` library's ``save_file`` (it writes straight from the tensors'
memory) and ``torch.save`` of a flat ``{name: tensor}`` dict, each of one file at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from uc_checkpoint.errors import UCCheckpointError

__all__ = ["FORMATS", "ExportFormat", "export_format", "files_of_index", "index_bytes"]


@dataclass(frozen=True)
class ExportFormat:
    """One output format's names and encoder.

    Attributes:
        name: ``"safetensors"`` or ``"torch"``.
        single: the file name of a one-file export (``model.safetensors``, ``pytorch_model.bin``).
        index: the index's file name (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``).
        stem: the shards' name stem (``model``, ``pytorch_model``).
        suffix: the shards' extension (``.safetensors``, ``.bin``).
    """

    name: str
    single: str
    index: str
    stem: str
    suffix: str

    def shard_name(self, number: int, count: int, export_id: str) -> str:
        """``<stem>-<number>-of-<count>-<export_id><suffix>``, numbers from 1, five digits as Hugging Face's."""
        return f"{self.stem}-{number:05d}-of-{count:05d}-{export_id}{self.suffix}"

    def is_shard_name(self, name: str) -> bool:
        """Whether ``name`` is a shard name this format gives (of any export id)."""
        pattern = rf"{re.escape(self.stem)}-\d{{5}}-of-\d{{5}}-[0-9a-f]{{8}}{re.escape(self.suffix)}"
        return re.fullmatch(pattern, name) is not None

    def entries(self) -> tuple[str, str]:
        """The names a loader opens first: the one file and the index."""
        return (self.single, self.index)

    def check_dtypes(self, dtypes: set[torch.dtype]) -> None:
        """Refuse, before anything is written, dtypes the format cannot hold.

        Raises:
            UCCheckpointError: the ``safetensors`` package is missing (the message names the extra
                ``uc-checkpoint[export]``).
            ValueError: a dtype the format has no code for (safetensors: complex128, quantized
                dtypes, ...), named.
        """
        if self.name != "safetensors":
            return
        save = _safetensors().save
        for dtype in sorted(dtypes, key=str):
            try:
                save({"probe": torch.empty(0, dtype=dtype)})
            except Exception as exc:  # noqa: BLE001 - the library's own refusal, any type
                raise ValueError(f"safetensors cannot hold tensors of dtype {dtype}: {exc}") from exc

    def write(self, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
        """Encode ``tensors`` (contiguous, on CPU) into the local file ``path``.

        safetensors: ``save_file`` with the header metadata ``{"format": "pt"}`` that
        ``transformers`` asks for. torch: ``torch.save`` of the dict (``torch.load(...,
        weights_only=True)`` reads it).
        """
        if self.name == "safetensors":
            _safetensors().save_file(dict(tensors), str(path), metadata={"format": "pt"})
        else:
            torch.save(dict(tensors), path)


FORMATS: dict[str, ExportFormat] = {
    "safetensors": ExportFormat(
        "safetensors", "model.safetensors", "model.safetensors.index.json", "model", ".safetensors"
    ),
    "torch": ExportFormat("torch", "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model", ".bin"),
}


def export_format(name: str) -> ExportFormat:
    """The :class:`ExportFormat` called ``name``; for ``safetensors`` the package must be installed.

    Raises:
        ValueError: an unknown format name.
        UCCheckpointError: ``safetensors`` is asked for and the package is missing.
    """
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown export format {name!r}; choose one of {sorted(FORMATS)}")
    if fmt.name == "safetensors":
        _safetensors()
    return fmt


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise UCCheckpointError(
            "exporting to safetensors needs the safetensors package: pip install 'uc-checkpoint[export]'"
        ) from exc
    return safetensors.torch


def index_bytes(weight_map: Mapping[str, str], total_size: int, extra: Mapping[str, str]) -> bytes:
    """Hugging Face's index: ``{"metadata": {"total_size": <tensor bytes>, **extra}, "weight_map":
    {name: file}}``, names in sorted order, as JSON bytes."""
    body = {"metadata": {"total_size": total_size, **extra}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(body, indent=2) + "\n").encode()


def files_of_index(raw: bytes | None) -> set[str] | None:
    """The shard file names an index's ``weight_map`` points at, keeping only plain names of this
    location (no ``/``, no ``..``: nothing outside it is ever deleted); None for bytes that are not
    such an index."""
    try:
        weight_map = json.loads(raw or b"null")["weight_map"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(weight_map, dict):
        return None
    return {f for f in weight_map.values() if isinstance(f, str) and f and "/" not in f and f not in (".", "..")}
