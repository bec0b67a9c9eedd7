"""What each save and load did, as plain records: exposed through the Python API
(``UCVolumeWriter.last_record``, ``UCVolumeReader.last_record``, ``CheckpointManager.last_save``), logged
through :mod:`logging` (INFO), and, when an MLflow run is active, logged to it
(:func:`log_to_mlflow`)."""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class TransferRecord:
    """One rank's side of one save or load.

    Attributes:
        op: ``"save"`` or ``"load"``.
        location: the checkpoint's path or URL.
        rank: the rank this record is from.
        bytes: data bytes this rank uploaded (save) or read from the volume (load).
        files: data files this rank wrote or read.
        total_s: seconds in DCP's write/read step on this rank (serialising, transfers, verification).
        staging_s: save: seconds DCP's serialiser spent writing the rank's files into staging (uploads
            run meanwhile); load: 0 (reads deserialise as data arrives).
        transfer_s: seconds from the first upload/download starting to the last one finishing.
        retries: requests the store's client retried (throttling, 5xx, timeouts, cut connections).
    """

    op: str
    location: str
    rank: int
    bytes: int
    files: int
    total_s: float
    staging_s: float
    transfer_s: float
    retries: int

    @property
    def throughput_mb_s(self) -> float:
        """Bytes over ``total_s``, in MB/s (10^6 bytes per second)."""
        return self.bytes / max(self.total_s, 1e-9) / 1e6

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "throughput_mb_s": self.throughput_mb_s}

    def describe(self) -> str:
        verb = "to" if self.op == "save" else "from"
        return (
            f"{self.op} rank {self.rank}: {self.files} files, {self.bytes} bytes {verb} {self.location} in "
            f"{self.total_s:.3f} s ({self.throughput_mb_s:.1f} MB/s; staging {self.staging_s:.3f} s, "
            f"transfers {self.transfer_s:.3f} s, {self.retries} retries)"
        )


@dataclass
class SaveEvent:
    """One checkpoint save as :class:`~uc_checkpoint.ops.manager.CheckpointManager` saw it (all ranks).

    Attributes:
        step: the training step saved.
        location: the checkpoint's path or URL.
        blocked_s: seconds the training loop was blocked in ``save()`` (the staging copy for async
            saves; the whole save for synchronous ones).
        publish_s: seconds from ``save()`` until ``.metadata`` was published (None: the save failed).
        bytes: total size of the checkpoint's data files (from its manifest; None when unknown).
        files: number of data files (None when unknown).
        error: the failure, in one line, or None.
    """

    step: int
    location: str
    blocked_s: float
    publish_s: float | None = None
    bytes: int | None = None
    files: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.publish_s is not None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def active_mlflow_run_id() -> str | None:
    """The id of the active MLflow run, or None (also when MLflow was never imported: a job that
    uses MLflow has imported it by the time it saves, and nothing else should pay for the import)."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        run = mlflow.active_run()
    except Exception:  # noqa: BLE001 - observability must never break a save
        return None
    return None if run is None else run.info.run_id


def log_to_mlflow(run_id: str, event: SaveEvent) -> None:
    """Log a save to MLflow run ``run_id``: ``checkpoint/blocked_s``, ``checkpoint/publish_s``,
    ``checkpoint/bytes`` and ``checkpoint/MBps`` as metrics at the training step, the location as
    the tag ``checkpoint/location`` (and ``checkpoint/step``). Failures are logged, never raised.
    Uses the tracking client with an explicit run id, so it works from the thread that completes an
    async save."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        metrics = {"checkpoint/blocked_s": event.blocked_s}
        if event.publish_s is not None:
            metrics["checkpoint/publish_s"] = event.publish_s
        if event.bytes is not None:
            metrics["checkpoint/bytes"] = float(event.bytes)
            if event.publish_s:
                metrics["checkpoint/MBps"] = event.bytes / event.publish_s / 1e6
        for key, value in metrics.items():
            client.log_metric(run_id, key, value, step=event.step)
        if event.ok:
            client.set_tag(run_id, "checkpoint/location", event.location)
            client.set_tag(run_id, "checkpoint/step", str(event.step))
        else:
            client.set_tag(run_id, "checkpoint/last_error", (event.error or "")[:500])
    except Exception:  # noqa: BLE001 - observability must never break training
        logger.warning("could not log checkpoint step %d to MLflow run %s", event.step, run_id, exc_info=True)


__all__ = ["SaveEvent", "TransferRecord", "active_mlflow_run_id", "log_to_mlflow"]
