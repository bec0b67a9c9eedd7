"""The Databricks AI Runtime job bundle (examples/databricks/): its databricks.yml carries the fields
Databricks documents for an ``ai_runtime_task``, its build script makes the code archive the task
points at, and its command.sh, run here as the runtime runs it on each node (from the unpacked
archive, with NODE_RANK, WORLD_SIZE = nodes, MASTER_ADDR, MASTER_PORT set; the /Volumes root
replaced by a temp dir through UC_CHECKPOINT_ROOT), trains on one node and on two simulated nodes,
and after the whole job is killed mid-upload a second run of command.sh (a job retry) resumes and
finishes bit-identical to the one-node run, every step on the same samples.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.scripts.example_jobs import (
    REPO,
    SHARDS,
    Node,
    chain,
    differing_params,
    free_port,
    held_env,
    job_env,
    read_samples,
    start,
    wait_for,
)
from uc_checkpoint.ops.catalog import list_steps
from uc_checkpoint.volumes import LocalVolume

BUNDLE = REPO / "examples" / "databricks"
TOP = "uc_checkpoint_example"  # the archive's top-level directory: $CODE_SOURCE_PATH's name
JOB_TIMEOUT = 120
TRAIN = f"--steps 12 --save-every 3 --batch-size 4 --shards {SHARDS} --samples-per-shard 64 --data-workers 1"
TRAIN += " --log-every 3 --timeout-s 60"


def test_databricks_yml_has_the_documented_ai_runtime_task_fields() -> None:
    config = yaml.safe_load((BUNDLE / "databricks.yml").read_text())
    job = config["resources"]["jobs"]["train"]
    (task,) = job["tasks"]
    air = task["ai_runtime_task"]
    assert air["experiment"] == "${var.experiment}"
    assert air["code_source_path"].endswith("/code.tgz")
    assert config["artifacts"]["code_source"]["files"] == [{"source": "./dist/code.tgz"}]
    (deployment,) = air["deployments"]  # exactly one deployment: every node runs command.sh
    assert deployment["command_path"] == "${workspace.file_path}/src/command.sh"
    assert set(deployment["compute"]) == {"accelerator_type", "accelerator_count"}
    assert config["variables"]["accelerator_type"]["default"] in {"GPU_1xA10", "GPU_1xH100", "GPU_8xH100"}
    per_node = int(config["variables"]["accelerator_type"]["default"].split("x")[0].removeprefix("GPU_"))
    assert config["variables"]["accelerator_count"]["default"] % per_node == 0
    # Retries, timeout and environment live on the task, not in ai_runtime_task.
    assert task["max_retries"] >= 1 and task["min_retry_interval_millis"] > 0
    assert task["retry_on_timeout"] is True and task["timeout_seconds"] > 0
    (env,) = job["environments"]
    assert env["environment_key"] == task["environment_key"]
    assert "${var.plugin_requirement}" in env["spec"]["dependencies"]
    sidecar = yaml.safe_load((BUNDLE / "src" / "requirements.yaml").read_text())
    assert "uc-checkpoint" in sidecar["dependencies"] and sidecar["version"] == env["spec"]["environment_version"]
    assert "src/**" in config["sync"]["include"]


@pytest.fixture(scope="module")
def code_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The archive the bundle builds, unpacked as the runtime unpacks it: $CODE_SOURCE_PATH."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(["bash", str(BUNDLE / "build_tarball.sh"), str(out)], check=True, capture_output=True, timeout=60)
    with tarfile.open(out / "code.tgz") as tgz:
        names = tgz.getnames()
        tgz.extractall(out / "code_source", filter="data")
    assert {n.split("/")[0] for n in names} == {TOP}, names
    return out / "code_source" / TOP


def test_the_archive_holds_command_sh_and_the_training_script(code_source: Path) -> None:
    assert os.access(code_source / "command.sh", os.X_OK)
    assert (code_source / "train_fsdp.py").read_bytes() == (REPO / "examples" / "train_fsdp.py").read_bytes()
    assert (code_source / "requirements.yaml").exists() and (code_source / "env_vars.json").exists()


def node_env(
    base: dict[str, str], code_source: Path, root: Path, node: int, nodes: int, port: int, **more: str
) -> dict[str, str]:
    """What the runtime sets on a node, plus the venv's torchrun on PATH."""
    env = dict(base)
    env.update(
        CODE_SOURCE_PATH=str(code_source),
        UC_CHECKPOINT_ROOT=str(root),
        NODE_RANK=str(node),
        WORLD_SIZE=str(nodes),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PATH=f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
        **more,
    )
    return env


def command_sh(run: str, node: int, workdir: Path, code_source: Path, env: dict[str, str]) -> Node:
    """command.sh of node ``node`` of the job run ``run`` (the nodes of a run share its logs' names)."""
    args = f" --samples-log {workdir / f'samples-{run}'} --final {workdir / f'final-{run}.pt'}"
    cmd = ["bash", str(code_source / "command.sh")]
    return start(f"{run}-node{node}", workdir, cmd, dict(env, TRAIN_ARGS=TRAIN + args))


def test_command_sh_without_a_checkpoint_root_names_the_variable(code_source: Path, tmp_path: Path) -> None:
    env = node_env(job_env(tmp_path), code_source, tmp_path, 0, 1, free_port())
    del env["UC_CHECKPOINT_ROOT"]
    proc = subprocess.run(
        ["bash", str(code_source / "command.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "UC_CHECKPOINT_ROOT is not set" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_command_sh_one_node_then_two_nodes_killed_and_retried(code_source: Path, tmp_path: Path) -> None:
    # One node, two GPUs' worth of ranks: the reference.
    root1 = tmp_path / "Volumes-one-node"
    env = node_env(job_env(tmp_path / "staging-one"), code_source, root1, 0, 1, free_port(), GPUS_PER_NODE="2")
    one = command_sh("one-node", 0, tmp_path, code_source, env)
    assert one.wait(JOB_TIMEOUT) == 0, one.tail()
    assert {i.step for i in list_steps(LocalVolume(root1)) if i.published} == {6, 9, 12}

    # Two nodes of one rank each; the whole job is killed while step 9 uploads (held there).
    root2 = tmp_path / "Volumes-two-nodes"
    port, hold = free_port(), tmp_path / "hold"
    nodes = [
        command_sh(
            "run1",
            n,
            tmp_path,
            code_source,
            node_env(held_env(tmp_path / f"staging-{n}", hold, "step_00000009"), code_source, root2, n, 2, port),
        )
        for n in (0, 1)
    ]
    wait_for(lambda: any(hold.glob("upload-started-*")), JOB_TIMEOUT, f"an upload of step 9 ({nodes[0].log})")
    for node in nodes:
        node.kill()
    published = {i.step: i.published for i in list_steps(LocalVolume(root2))}
    assert published.get(6) is True and not published.get(9), published

    # The retry: command.sh again on both nodes, as the job's retry policy would.
    retry = [
        command_sh(
            "run2",
            n,
            tmp_path,
            code_source,
            node_env(job_env(tmp_path / f"staging-{n}"), code_source, root2, n, 2, port),
        )
        for n in (0, 1)
    ]
    for node in retry:
        assert node.wait(JOB_TIMEOUT) == 0, node.tail()
    assert "resumed at step 6" in retry[0].tail(200_000)
    assert differing_params(tmp_path / "final-one-node.pt", tmp_path / "final-run2.pt") == []
    steps = chain([(tmp_path / "samples-run1", 6), (tmp_path / "samples-run2", 12)])
    assert steps == read_samples(tmp_path / "samples-one-node")
