"""One training job that logs to MLflow, as a (retried) job would: a process of its own.

Usage: mlflow_job.py ROOT PREFER STEP [STEP ...]   (MLFLOW_TRACKING_URI names the server;
MLFLOW_RUN_ID may name a run; PREFER is resume_mlflow_run's ``prefer``: checkpoint or environment)

Loads the newest checkpoint under ROOT if there is one, makes an MLflow run active with
``resume_mlflow_run(manager, prefer=PREFER)`` (the checkpoint's run or the one ``MLFLOW_RUN_ID``
names, whichever PREFER says, else a new one), saves each STEP (async, waited for), ends the run
and prints ``RUN <run id> RESUMED <recorded run id or None> LOADED <step or None>``.
"""

from __future__ import annotations

import logging
import sys
import warnings

import torch

from uc_checkpoint.observability import resume_mlflow_run
from uc_checkpoint.ops.manager import CheckpointManager

warnings.filterwarnings("ignore")


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    root, prefer, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
    manager = CheckpointManager(root, keep_last=None)
    state = {"w": torch.zeros(256, 256), "step": 0}
    loaded = manager.load(state) if manager.latest() is not None else None
    with resume_mlflow_run(manager, prefer=prefer, run_name="uc-checkpoint-test") as run:
        for step in steps:
            state = {"w": torch.full((256, 256), float(step)), "step": step}
            manager.save(step, state)
            manager.wait()
            assert manager.last_save is not None and manager.last_save.ok, manager.last_save
    print(f"RUN {run.info.run_id} RESUMED {manager.resumed_mlflow_run_id} LOADED {loaded}", flush=True)


if __name__ == "__main__":
    main()
