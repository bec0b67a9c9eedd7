"""uc_checkpoint: staged, crash-safe PyTorch Distributed Checkpoint storage for volumes.

``UCVolumeWriter`` / ``UCVolumeReader`` are DCP storage writer/reader plugins::

    dcp.async_save(state_dict, storage_writer=UCVolumeWriter(path))
    dcp.load(state_dict, storage_reader=UCVolumeReader(path))

The names users reach for are all here: ``CheckpointManager`` (step-numbered checkpoints, resume,
retention), ``DataTracker``/``ShardSpec`` (the data-pipeline state, pure Python),
``TrackedDataLoader``/``TrackedShardDataset``/``TrackerStateful`` (its DataLoader and DCP
``Stateful`` wiring), ``WriterOptions``/``ReaderOptions`` (the manager's typed settings), ``collect_garbage``, ``list_root``/``describe_checkpoint``/``verify_checkpoint``
(what ``uc-checkpoint ls``/``inspect``/``verify`` do), the volumes, and every error class.

Names that need torch are imported on first use (PEP 562 ``__getattr__``; ``dir()`` lists them
before), so that ``import uc_checkpoint.data.tracker``, ``uc_checkpoint.errors`` or the
``uc-checkpoint`` command line (``uc_checkpoint.cli``) costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from uc_checkpoint.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    DataFormatError,
    DataLoadingError,
    DatasetMismatchError,
    ExactlyOnceError,
    LocationNotEmptyError,
    PeerTimeoutError,
    RemoteRankError,
    StagingError,
    StateChangedWhileStagingError,
    TrackerStateError,
    TransferError,
    UCCheckpointError,
    UnsafeMetadataError,
    VolumeError,
)

if TYPE_CHECKING:
    from uc_checkpoint.data.loading import TrackedDataLoader, TrackedShardDataset, TrackerStateful
    from uc_checkpoint.data.tracker import DataTracker, ShardSpec
    from uc_checkpoint.dcp.buffers import StagingBuffers
    from uc_checkpoint.dcp.options import ReaderOptions, Staging, WriterOptions
    from uc_checkpoint.dcp.planner import UCSavePlanner
    from uc_checkpoint.dcp.reader import UCVolumeReader
    from uc_checkpoint.dcp.writer import UCVolumeWriter
    from uc_checkpoint.observability import resume_mlflow_run
    from uc_checkpoint.ops.export import ExportSummary, export_checkpoint
    from uc_checkpoint.ops.garbage import GCReport, collect_garbage
    from uc_checkpoint.ops.interval import (
        BlockedFraction,
        EverySeconds,
        EverySteps,
        IntervalPolicy,
        Looser,
        Tighter,
        YoungDaly,
    )
    from uc_checkpoint.ops.manager import CheckpointManager
    from uc_checkpoint.ops.summary import describe_checkpoint, list_root
    from uc_checkpoint.ops.verify import verify_checkpoint
    from uc_checkpoint.volumes import FsspecVolume, LocalVolume, MemoryVolume, S3Volume, Volume, open_volume

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "UCVolumeReader": ".dcp.reader",
    "UCVolumeWriter": ".dcp.writer",
    "UCSavePlanner": ".dcp.planner",
    "StagingBuffers": ".dcp.buffers",
    "CheckpointManager": ".ops.manager",
    "IntervalPolicy": ".ops.interval",
    "EverySteps": ".ops.interval",
    "EverySeconds": ".ops.interval",
    "BlockedFraction": ".ops.interval",
    "YoungDaly": ".ops.interval",
    "Tighter": ".ops.interval",
    "Looser": ".ops.interval",
    "resume_mlflow_run": ".observability",
    "DataTracker": ".data.tracker",
    "ShardSpec": ".data.tracker",
    "TrackedDataLoader": ".data.loading",
    "TrackedShardDataset": ".data.loading",
    "TrackerStateful": ".data.loading",
    "collect_garbage": ".ops.garbage",
    "GCReport": ".ops.garbage",
    "export_checkpoint": ".ops.export",
    "ExportSummary": ".ops.export",
    "list_root": ".ops.summary",
    "describe_checkpoint": ".ops.summary",
    "verify_checkpoint": ".ops.verify",
    "Volume": ".volumes",
    "LocalVolume": ".volumes",
    "S3Volume": ".volumes",
    "FsspecVolume": ".volumes",
    "open_volume": ".volumes",
    "MemoryVolume": ".volumes",
    "WriterOptions": ".dcp.options",
    "ReaderOptions": ".dcp.options",
    "Staging": ".dcp.options",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'uc_checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BlockedFraction",
    "CheckpointExistsError",
    "CheckpointManager",
    "EverySeconds",
    "EverySteps",
    "IntervalPolicy",
    "Looser",
    "Tighter",
    "YoungDaly",
    "resume_mlflow_run",
    "DataTracker",
    "ExportSummary",
    "FsspecVolume",
    "GCReport",
    "LocalVolume",
    "S3Volume",
    "ShardSpec",
    "TrackedDataLoader",
    "TrackedShardDataset",
    "TrackerStateful",
    "collect_garbage",
    "describe_checkpoint",
    "export_checkpoint",
    "list_root",
    "verify_checkpoint",
    "ConcurrentSaveError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DataFormatError",
    "DataLoadingError",
    "DatasetMismatchError",
    "ExactlyOnceError",
    "LocationNotEmptyError",
    "MemoryVolume",
    "ReaderOptions",
    "PeerTimeoutError",
    "RemoteRankError",
    "StagingError",
    "StateChangedWhileStagingError",
    "Staging",
    "StagingBuffers",
    "TrackerStateError",
    "TransferError",
    "UCCheckpointError",
    "UCSavePlanner",
    "UCVolumeReader",
    "UCVolumeWriter",
    "UnsafeMetadataError",
    "Volume",
    "VolumeError",
    "WriterOptions",
    "open_volume",
]
