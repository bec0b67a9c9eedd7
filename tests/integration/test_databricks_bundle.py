"""The Databricks AI Runtime job bundle (examples/databricks/): its databricks.yml carries the fields
Databricks documents for an ``ai_runtime_task``, its build script makes the code archive the task
points at, and its command.sh, run here as the runtime runs it on each node (from the unpacked
archive, with NODE_RANK, WORLD_SIZE = nodes, MASTER_ADDR, MASTER_PORT set; the /Volumes root
replaced by a temp dir through UC_CHECKPOINT_ROOT), trains on one node and on two simulated nodes,
and after the whole job is killed mid-upload a second run of command.sh (a job retry) resumes and
finishes bit-identical to the one-node run, every step on the same samples. The archive ships the
uc_checkpoint wheel, and installing it keeps the installed torch; command.sh takes the ranks per
node from GPUS_PER_NODE, else LOCAL_WORLD_SIZE, and splits TRAIN_ARGS as a shell splits words.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
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
    # The documented form: a tgz artifact whose one file is the archive, named by the task
    # relative to the bundle, as is command.sh.
    (artifact,) = config["artifacts"].values()
    assert artifact["type"] == "tgz" and artifact["files"] == [{"source": "./dist/code.tgz"}]
    assert air["code_source_path"] == "./dist/code.tgz"
    (deployment,) = air["deployments"]  # exactly one deployment: every node runs command.sh
    assert deployment["command_path"] == "./src/command.sh" and (BUNDLE / "src" / "command.sh").is_file()
    assert set(deployment["compute"]) == {"accelerator_type", "accelerator_count"}
    assert config["variables"]["accelerator_type"]["default"] in {"GPU_1xA10", "GPU_1xH100", "GPU_8xH100"}
    per_node = int(config["variables"]["accelerator_type"]["default"].split("x")[0].removeprefix("GPU_"))
    assert config["variables"]["accelerator_count"]["default"] % per_node == 0
    # Retries, timeout and environment live on the task, not in ai_runtime_task.
    assert task["max_retries"] >= 1 and task["min_retry_interval_millis"] > 0
    assert task["retry_on_timeout"] is True and task["timeout_seconds"] > 0
    (env,) = job["environments"]
    assert env["environment_key"] == task["environment_key"] and env["spec"]["environment_version"] == "5"
    sidecar = yaml.safe_load((BUNDLE / "src" / "requirements.yaml").read_text())
    assert sidecar["version"] == env["spec"]["environment_version"]
    # No requirement names the plugin: a package index's "uc-checkpoint" is never resolved.
    named = [*env["spec"].get("dependencies", []), *sidecar["dependencies"]]
    assert not [d for d in named if "uc-checkpoint" in d or "uc_checkpoint" in d], named
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


def test_the_archive_holds_command_sh_the_training_script_and_the_wheel(code_source: Path) -> None:
    assert os.access(code_source / "command.sh", os.X_OK)
    assert (code_source / "train_fsdp.py").read_bytes() == (REPO / "examples" / "train_fsdp.py").read_bytes()
    assert (code_source / "requirements.yaml").exists() and (code_source / "env_vars.json").exists()
    (wheel,) = (code_source / "wheels").glob("uc_checkpoint-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
    assert "uc_checkpoint/ops/manager.py" in names and not [n for n in names if "__pycache__" in n]


def test_installing_the_shipped_wheel_keeps_the_installed_torch(code_source: Path, tmp_path: Path) -> None:
    """What install_plugin.sh would do in this environment (pip's own dry-run report, no index):
    install the wheel of the archive and nothing else; torch, which the wheel requires, stays."""
    report = tmp_path / "report.json"
    env = dict(os.environ, PATH=f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cmd = [
        "bash",
        str(code_source / "install_plugin.sh"),
        "--dry-run",
        "--no-index",
        "--quiet",
        "--report",
        str(report),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"torch=={torch.__version__} kept" in proc.stdout
    installs = [(i["metadata"]["name"], i["download_info"]["url"]) for i in json.loads(report.read_text())["install"]]
    (wheel,) = (code_source / "wheels").glob("uc_checkpoint-*.whl")
    assert installs == [("uc-checkpoint", wheel.as_uri())], installs


def test_install_plugin_without_a_wheel_says_where_it_looked(code_source: Path, tmp_path: Path) -> None:
    bare = tmp_path / "code"
    bare.mkdir()
    (bare / "install_plugin.sh").write_bytes((code_source / "install_plugin.sh").read_bytes())
    proc = subprocess.run(["bash", str(bare / "install_plugin.sh")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"{bare / 'wheels'}, found 0" in proc.stderr, proc.stderr


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
    )
    env.update(more)
    return env


def command_sh(run: str, node: int, workdir: Path, code_source: Path, env: dict[str, str]) -> Node:
    """command.sh of node ``node`` of the job run ``run`` (the nodes of a run share its logs' names)."""
    args = f" --samples-log {workdir / f'samples-{run}'} --final {workdir / f'final-{run}.pt'}"
    cmd = ["bash", str(code_source / "command.sh")]
    return start(f"{run}-node{node}", workdir, cmd, dict(env, TRAIN_ARGS=TRAIN + args))


def run_command_sh(env: dict[str, str], code_source: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(code_source / "command.sh")], env=env, capture_output=True, text=True, timeout=60
    )


def test_command_sh_without_a_checkpoint_root_names_the_variable(code_source: Path, tmp_path: Path) -> None:
    env = node_env(job_env(tmp_path), code_source, tmp_path, 0, 1, free_port())
    del env["UC_CHECKPOINT_ROOT"]
    proc = run_command_sh(env, code_source)
    assert proc.returncode != 0 and "UC_CHECKPOINT_ROOT is not set" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        # GPUS_PER_NODE comes first: a bad one is reported even where LOCAL_WORLD_SIZE is good.
        ({"GPUS_PER_NODE": "eight", "LOCAL_WORLD_SIZE": "2"}, "ranks per node (GPUS_PER_NODE) must be"),
        ({"LOCAL_WORLD_SIZE": "0"}, "ranks per node (LOCAL_WORLD_SIZE) must be a positive integer, got '0'"),
        ({"NUM_NODES": "1:2"}, "nodes (NUM_NODES) must be a positive integer, got '1:2'"),  # not an elastic range
        ({"WORLD_SIZE": "0"}, "nodes (WORLD_SIZE) must be a positive integer, got '0'"),  # the runtime's
        ({"TRAIN_ARGS": "--steps 3 --samples-log '/tmp/no end"}, "TRAIN_ARGS cannot be split into arguments"),
    ],
)
def test_command_sh_refuses_bad_variables_naming_them(
    code_source: Path, tmp_path: Path, variables: dict[str, str], named: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"GPUS_PER_NODE", "LOCAL_WORLD_SIZE", "NUM_NODES"}}
    env = node_env(env, code_source, tmp_path, 0, 1, free_port(), **variables)
    proc = run_command_sh(env, code_source)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # nothing started


@pytest.mark.slow
def test_command_sh_takes_local_world_size_and_quoted_train_args(code_source: Path, tmp_path: Path) -> None:
    """Without GPUS_PER_NODE, LOCAL_WORLD_SIZE ranks; TRAIN_ARGS with quotes reach train_fsdp.py as
    the words a shell would make of them (a path with a space and a quote in it)."""
    logs = tmp_path / "run dir" / "it's"
    logs.mkdir(parents=True)
    args = f"--steps 2 --save-every 2 --batch-size 4 --shards {SHARDS} --samples-per-shard 64 --data-workers 0"
    args += f" --timeout-s 60 --samples-log {shlex.quote(str(logs / 'samples'))}"
    env = node_env(job_env(tmp_path / "staging"), code_source, tmp_path / "Volumes", 0, 1, free_port())
    env.pop("GPUS_PER_NODE", None)
    env.update(LOCAL_WORLD_SIZE="2", TRAIN_ARGS=args)
    node = start("local-world-size", tmp_path, ["bash", str(code_source / "command.sh")], env)
    assert node.wait(JOB_TIMEOUT) == 0, node.tail()
    assert "2 ranks (LOCAL_WORLD_SIZE)" in node.tail(200_000)
    assert sorted(p.name for p in logs.iterdir()) == ["samples-rank0.jsonl", "samples-rank1.jsonl"]
    assert set(read_samples(logs / "samples")) == {1, 2}


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
