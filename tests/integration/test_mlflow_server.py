"""MLflow as users run it: a real ``mlflow server`` (SQLite backend, artifacts in a temp dir) on
127.0.0.1, jobs in processes of their own that log to it over HTTP, and a retried job that resumes
from the checkpoint and keeps logging into the same run. Where ``MLFLOW_RUN_ID`` names another run,
``resume_mlflow_run``'s ``prefer`` decides: ``"checkpoint"`` keeps the checkpoint's run (a platform
that names a new run per attempt), ``"environment"`` follows the variable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import SCRIPTS, run_script
from uc_checkpoint.observability import active_mlflow_run_id, resume_mlflow_run
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.summary import describe_checkpoint


def job(
    root: Path, url: str, *steps: int, run_id: str | None = None, prefer: str = "checkpoint"
) -> tuple[str, str, str]:
    """Run tests/scripts/mlflow_job.py as its own process; (run id, resumed run id, step loaded)."""
    env = {"MLFLOW_TRACKING_URI": url, "UC_CHECKPOINT_STAGING_DIR": str(root.parent / "staging")}
    if run_id is not None:
        env["MLFLOW_RUN_ID"] = run_id
    saved = os.environ.pop("MLFLOW_RUN_ID", None)
    try:
        proc = run_script(
            [sys.executable, str(SCRIPTS / "mlflow_job.py"), str(root), prefer, *map(str, steps)], env=env
        )
    finally:
        if saved is not None:
            os.environ["MLFLOW_RUN_ID"] = saved
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RUN ")][-1].split()
    return line[1], line[3], line[5]


def recorded_run(root: Path, step: int) -> str | None:
    """The MLflow run the checkpoint of ``step`` records, read from its ``.metadata`` alone."""
    return describe_checkpoint(str(root / f"step_{step:08d}"), data_state=False)["saved_by"].get("mlflow_run_id")


def test_metrics_tags_and_a_retried_job_over_http(
    mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = MlflowClient(tracking_uri=mlflow_server)
    root = tmp_path / "run"

    # The first job: a new run, checkpoint metrics at the training step of each save.
    first, resumed, loaded = job(root, mlflow_server, 5, 10)
    assert (resumed, loaded) == ("None", "None")
    history = client.get_metric_history(first, "checkpoint/publish_s")
    assert [m.step for m in history] == [5, 10] and all(m.value > 0 for m in history)
    assert [m.step for m in client.get_metric_history(first, "checkpoint/blocked_s")] == [5, 10]
    sizes = client.get_metric_history(first, "checkpoint/bytes")
    assert [m.value >= 256 * 256 * 4 for m in sizes] == [True, True]
    run = client.get_run(first)
    assert run.data.tags["checkpoint/location"] == str(root / "step_00000010")
    assert run.data.tags["checkpoint/step"] == "10" and run.info.status == "FINISHED"
    assert recorded_run(root, 5) == recorded_run(root, 10) == first

    # The retried job: a new process resumes from step 10 and logs into the same run.
    again, resumed, loaded = job(root, mlflow_server, 15)
    assert (again, resumed, loaded) == (first, first, "10")
    assert [m.step for m in client.get_metric_history(first, "checkpoint/publish_s")] == [5, 10, 15]
    assert client.get_run(first).data.tags["checkpoint/step"] == "15"
    assert recorded_run(root, 15) == first

    # A retry whose launcher names a new run per attempt in MLFLOW_RUN_ID (Databricks AI Runtime):
    # with prefer="checkpoint" the checkpoint's run goes on, and the attempt's run gets nothing.
    attempt = client.create_run(run.info.experiment_id, run_name="attempt-2").info.run_id
    kept, resumed, loaded = job(root, mlflow_server, 17, run_id=attempt, prefer="checkpoint")
    assert (kept, resumed, loaded) == (first, first, "15")
    assert [m.step for m in client.get_metric_history(first, "checkpoint/publish_s")] == [5, 10, 15, 17]
    assert client.get_metric_history(attempt, "checkpoint/publish_s") == []
    assert recorded_run(root, 17) == first

    # With prefer="environment", MLFLOW_RUN_ID wins over the run the checkpoint recorded.
    other = client.create_run(run.info.experiment_id, run_name="named-by-env").info.run_id
    named, resumed, loaded = job(root, mlflow_server, 20, run_id=other, prefer="environment")
    assert (named, resumed, loaded) == (other, first, "17")
    assert [m.step for m in client.get_metric_history(other, "checkpoint/publish_s")] == [20]
    assert [m.step for m in client.get_metric_history(first, "checkpoint/publish_s")] == [5, 10, 15, 17]
    assert recorded_run(root, 20) == other

    # prefer says one of the two; anything else is refused before MLflow is touched.
    with pytest.raises(ValueError, match="prefer must be one of checkpoint, environment; got 'env'"):
        resume_mlflow_run(CheckpointManager(str(root)), prefer="env")
    assert active_mlflow_run_id() is None

    # Here no run is active and none is named: a save logs nothing and records no run; a load
    # exposes the run its checkpoint recorded.
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("UC_CHECKPOINT_STAGING_DIR", str(tmp_path / "staging"))
    assert active_mlflow_run_id() is None
    manager = CheckpointManager(str(root), keep_last=None)
    state = {"w": torch.zeros(256, 256), "step": 0}
    assert manager.load(state) == 20 and manager.resumed_mlflow_run_id == other
    manager.save(25, state)
    manager.wait()
    assert manager.last_save is not None and manager.last_save.ok and recorded_run(root, 25) is None
    assert len(client.get_metric_history(other, "checkpoint/publish_s")) == 1
    assert manager.load(state) == 25 and manager.resumed_mlflow_run_id is None
