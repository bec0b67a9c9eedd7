"""uc_checkpoint: staged, crash-safe PyTorch Distributed Checkpoint storage for volumes.

``UCVolumeWriter`` / ``UCVolumeReader`` are DCP storage writer/reader plugins::

    dcp.async_save(state_dict, storage_writer=UCVolumeWriter(path))
    dcp.load(state_dict, storage_reader=UCVolumeReader(path))

The data-pipeline tracker lives in :mod:`uc_checkpoint.data_tracker` (pure Python) and
:mod:`uc_checkpoint.data_loading` (its DataLoader and DCP ``Stateful`` wiring).

Names that need torch are imported on first use (PEP 562 ``__getattr__``), so that
``import uc_checkpoint.data_tracker`` or ``uc_checkpoint.errors`` costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointExistsError,
    ConcurrentSaveError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DataLoadingError,
    DatasetMismatchError,
    LocationNotEmptyError,
    StagingError,
    TrackerStateError,
    TransferError,
    UCCheckpointError,
    UnsafeMetadataError,
    VolumeError,
)

if TYPE_CHECKING:
    from .reader import UCVolumeReader
    from .volumes import Volume, open_volume
    from .writer import UCVolumeWriter

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "UCVolumeReader": ".reader",
    "UCVolumeWriter": ".writer",
    "Volume": ".volumes",
    "open_volume": ".volumes",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'uc_checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


__all__ = [
    "CheckpointExistsError",
    "ConcurrentSaveError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DataLoadingError",
    "DatasetMismatchError",
    "LocationNotEmptyError",
    "StagingError",
    "TrackerStateError",
    "TransferError",
    "UCCheckpointError",
    "UCVolumeReader",
    "UCVolumeWriter",
    "UnsafeMetadataError",
    "Volume",
    "VolumeError",
    "open_volume",
]
