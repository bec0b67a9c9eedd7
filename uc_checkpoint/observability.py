"""What each save and load did, as plain records: exposed through the Python API
(``UCVolumeWriter.last_record``, ``UCVolumeReader.last_record``, ``CheckpointManager.last_save``), logged
through :mod:`logging` (INFO), and, when an MLflow run is active, logged to it
(:func:`log_to_mlflow`).

MLflow: each checkpoint records the run its save logged to (:func:`current_mlflow_run_id`, in the
manifest's ``saved_by``, see :mod:`uc_checkpoint.format.layout`), so that a retried job resumes
logging into the same run (:func:`resume_mlflow_run`). Docs: docs/operating.md, "MLflow"."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

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


def current_mlflow_run_id() -> str | None:
    """The MLflow run a save logs to and records: the active run (:func:`active_mlflow_run_id`),
    else the ``MLFLOW_RUN_ID`` environment variable (the run a launcher or a retried job names),
    else None."""
    return active_mlflow_run_id() or os.environ.get("MLFLOW_RUN_ID") or None


def recorded_mlflow_run_id(manifest: Mapping[str, Any] | None) -> str | None:
    """The MLflow run id a checkpoint's manifest records (``saved_by["mlflow_run_id"]``), or None
    (none recorded, or a manifest from another writer)."""
    saved_by = (manifest or {}).get("saved_by")
    run_id = saved_by.get("mlflow_run_id") if isinstance(saved_by, Mapping) else None
    return run_id if isinstance(run_id, str) and run_id else None


class ResumedFrom(Protocol):
    """What :func:`resume_mlflow_run` needs of a :class:`~uc_checkpoint.ops.manager.CheckpointManager`:
    the MLflow run id recorded in the checkpoint it loaded (None: none, or nothing loaded)."""

    resumed_mlflow_run_id: str | None


#: What :func:`resume_mlflow_run` continues first when both are there: the run the loaded checkpoint
#: recorded, or the run ``MLFLOW_RUN_ID`` names.
MLFLOW_RUN_PREFERENCES = ("checkpoint", "environment")


def resume_mlflow_run(manager: ResumedFrom, *, prefer: Literal["checkpoint", "environment"], **start_run: Any) -> Any:
    """Make the MLflow run a retried job logs to active, and return it (``mlflow.ActiveRun``):

    1. an already active run wins (returned as it is);
    2. else, with ``prefer="checkpoint"``, the run the checkpoint ``manager`` loaded recorded
       (:attr:`CheckpointManager.resumed_mlflow_run_id`), continued, else the run
       ``MLFLOW_RUN_ID`` names; with ``prefer="environment"`` the other way round;
    3. else a new run, started with ``start_run`` (``mlflow.start_run``'s keyword arguments, such
       as ``run_name``; used only for a new run).

    Which to prefer depends on the launcher. Where ``MLFLOW_RUN_ID`` names a new run for every
    attempt (Databricks AI Runtime: a retry is a new MLflow run), ``"checkpoint"`` keeps one run
    across retries, and the attempt's own run is left as the platform made it. Where a person or
    an orchestrator sets ``MLFLOW_RUN_ID`` to say where a job logs, ``"environment"`` obeys it.
    Without ``MLFLOW_RUN_ID`` (torchrun by hand, Slurm) both continue the checkpoint's run.

    Call it after ``manager.load(...)``, where the job logs to MLflow (usually rank 0). A
    ``with`` block around the returned run ends it on exit, as ``mlflow.start_run`` does.
    Metrics keep going to the run at the training step of each save: a run resumed this way gets
    the retried job's saves after the first job's. Steps trained again after a crash (those after
    the checkpoint loaded) are logged again at the same steps: MLflow keeps both values.

    Raises:
        ValueError: ``prefer`` is neither ``"checkpoint"`` nor ``"environment"``.
        what ``mlflow.start_run`` raises (an unknown run id, a tracking server that cannot be
        reached).
    """
    if prefer not in MLFLOW_RUN_PREFERENCES:
        raise ValueError(
            f"resume_mlflow_run: prefer must be one of {', '.join(MLFLOW_RUN_PREFERENCES)}; got {prefer!r}"
        )
    import mlflow

    active = mlflow.active_run()
    if active is not None:
        return active
    named = os.environ.get("MLFLOW_RUN_ID") or None
    recorded = manager.resumed_mlflow_run_id
    first, second = (recorded, named) if prefer == "checkpoint" else (named, recorded)
    run_id = first or second
    if run_id is None:
        return mlflow.start_run(**start_run)
    if run_id == recorded:
        logger.info("continuing MLflow run %s, recorded in the checkpoint loaded", run_id)
    if named is not None and run_id != named:
        logger.info("MLFLOW_RUN_ID names run %s; it is left as it is (prefer=%r)", named, prefer)
    return mlflow.start_run(run_id=run_id)


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


__all__ = [
    "MLFLOW_RUN_PREFERENCES",
    "SaveEvent",
    "TransferRecord",
    "active_mlflow_run_id",
    "current_mlflow_run_id",
    "log_to_mlflow",
    "recorded_mlflow_run_id",
    "resume_mlflow_run",
]
