"""uc_checkpoint: staged, crash-safe PyTorch Distributed Checkpoint storage for volumes.

``UCVolumeWriter`` / ``UCVolumeReader`` are DCP storage writer/reader plugins::

    dcp.async_save(state_dict, storage_writer=UCVolumeWriter(path))
    dcp.load(state_dict, storage_reader=UCVolumeReader(path))
"""

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LocationNotEmptyError,
    StagingError,
    TransferError,
    UCCheckpointError,
    VolumeError,
)
from .reader import UCVolumeReader
from .volumes import Volume, open_volume
from .writer import UCVolumeWriter

__version__ = "0.1.0"

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "LocationNotEmptyError",
    "StagingError",
    "TransferError",
    "UCCheckpointError",
    "UCVolumeReader",
    "UCVolumeWriter",
    "Volume",
    "VolumeError",
    "open_volume",
]
