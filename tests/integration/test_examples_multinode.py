"""The example job (examples/train_fsdp.py) run as a user runs it: one node, two nodes, a node lost.

"Nodes" are torchrun agents on this machine, each with its own staging directory, meeting at a
c10d rendezvous on 127.0.0.1 (docs: "Two nodes on one machine" in the environment notes):

* one node, two ranks, uninterrupted: the reference;
* two nodes of one rank each; node 1 is SIGKILLed (agent and rank) while its upload of the step-9
  checkpoint is in flight (held there by tests/scripts/upload_hold, so the kill lands there every
  time); node 0 must then fail on its own; step 9 is not published. Both nodes are relaunched as
  a job retry would: the job resumes from step 6 and finishes with final parameters bit-identical
  to the reference, every step having trained on the reference's samples;
* the finished two-node run resumed on one node (one rank, same global batch) for 3 more steps:
  every sample trained on exactly once across all of it or still listed as remaining;
* a job logging to a real ``mlflow server`` gets SIGTERM (a preemption notice): every rank stops at
  the same step and that step is checkpointed; the retry resumes there and keeps logging into the
  same MLflow run, the loss every ``--log-every`` steps, never per batch;
* two nodes with two DataLoader workers per rank; every process of node 1 (agent, rank, workers) gets
  SIGTERM at once, as Slurm or a cgroup stop sends it, while the job waits on node 1's upload of step
  3 (so the stop lands at step 7, with the workers mid-turn): both nodes stop at that step and
  publish it, no worker fails a rank, each agent exits 1 while the ranks exit 143, and the retry
  finishes bit-identical to an uninterrupted run with the same workers, every step on its samples.
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.scripts.example_jobs import (
    EXAMPLE,
    TRAIN_ARGS,
    Node,
    chain,
    data_state,
    differing_params,
    exactly_once_problems,
    free_port,
    held_env,
    job_env,
    read_samples,
    start,
    torchrun,
    two_node_launch,
    wait_for,
)
from uc_checkpoint.ops.catalog import list_steps
from uc_checkpoint.volumes import LocalVolume

pytestmark = pytest.mark.slow

STEPS, BATCH = 12, 4  # per rank; the global batch is 8 in every run
JOB_TIMEOUT = 120  # seconds a job may take (a guard against a hang)
TWO_WORKERS = ["--data-workers", "2"]  # after TRAIN_ARGS: the last one counts
# torchrun SIGKILLs its ranks this many seconds after passing a stop signal on (30 by default): more
# than save_final's budget in the example (60 s), as examples/README.md advises.
SHUTDOWN_TIMEOUT = "--shutdown-timeout=90"


def train_args(workdir: Path, label: str, root: Path, steps: int = STEPS, batch: int = BATCH) -> list[str]:
    return [
        str(EXAMPLE),
        "--checkpoint-root",
        str(root),
        "--steps",
        str(steps),
        "--batch-size",
        str(batch),
        "--samples-log",
        str(workdir / f"samples-{label}"),
        "--final",
        str(workdir / f"final-{label}.pt"),
        *TRAIN_ARGS,
    ]


def published(root: Path) -> dict[int, bool]:
    return {info.step: bool(info.published) for info in list_steps(LocalVolume(root))}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("examples")


@pytest.fixture(scope="module")
def reference(workdir: Path) -> Node:
    """One node, two ranks, uninterrupted."""
    node = start(
        "reference",
        workdir,
        torchrun("--standalone", "--nproc-per-node=2", *train_args(workdir, "reference", workdir / "vol-reference")),
        job_env(workdir / "staging-reference"),
    )
    node.wait(JOB_TIMEOUT)
    return node


@pytest.fixture(scope="module")
def two_nodes(workdir: Path, reference: Node) -> dict:
    """Two nodes; node 1 lost while uploading step 9; both relaunched; the job finishes."""
    root = workdir / "vol-2nodes"
    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    hold = workdir / "hold"

    # Node 0 hosts the rendezvous store; node 1 is the one lost.
    node0 = start(
        "run1-node0",
        workdir,
        torchrun(*two_node_launch(port, rdzv, 0), *train_args(workdir, "run1", root)),
        job_env(workdir / "staging-node0"),
    )
    node1 = start(
        "run1-node1",
        workdir,
        torchrun(*two_node_launch(port, rdzv, 1), *train_args(workdir, "run1", root)),
        held_env(workdir / "staging-node1", hold, "step_00000009"),
    )
    wait_for(lambda: any(hold.glob("upload-started-*")), JOB_TIMEOUT, f"node 1 to upload step 9 ({node1.log})")
    node1.kill()
    node0_rc = node0.wait(JOB_TIMEOUT)  # a dead peer: its collectives fail, torchrun gives up
    after_kill = published(root)

    port, rdzv = free_port(), uuid.uuid4().hex[:8]  # a job retry: a new rendezvous
    retry = [
        start(
            f"run2-node{n}",
            workdir,
            torchrun(*two_node_launch(port, rdzv, n), *train_args(workdir, "run2", root)),
            job_env(workdir / f"staging-node{n}"),
        )
        for n in (0, 1)
    ]
    retry_rc = [node.wait(JOB_TIMEOUT) for node in retry]
    return {"root": root, "node0_rc": node0_rc, "after_kill": after_kill, "retry": retry, "retry_rc": retry_rc}


@pytest.fixture(scope="module")
def reference_two_workers(workdir: Path) -> Node:
    """One node, two ranks with two DataLoader workers each, uninterrupted."""
    args = [*train_args(workdir, "reference-w2", workdir / "vol-reference-w2"), *TWO_WORKERS]
    node = start(
        "reference-w2", workdir, torchrun("--standalone", "--nproc-per-node=2", *args), job_env(workdir / "staging-w2")
    )
    assert node.wait(JOB_TIMEOUT) == 0, node.tail()
    return node


def test_one_node_two_ranks_trains_and_checkpoints(workdir: Path, reference: Node) -> None:
    assert reference.proc.returncode == 0, reference.tail()
    assert published(workdir / "vol-reference") == {6: True, 9: True, 12: True}  # keep_last=3
    samples = read_samples(workdir / "samples-reference")
    assert sorted(samples) == list(range(1, STEPS + 1))
    assert all(len(v) == 2 * BATCH for v in samples.values())
    assert (workdir / "final-reference.pt").exists()


def test_losing_a_node_mid_upload_then_a_retry_finishes_bit_identical(workdir: Path, two_nodes: dict) -> None:
    assert two_nodes["node0_rc"] != 0, "node 0 must fail when node 1 is lost"
    # The checkpoint whose upload was cut is not published; the one before is.
    assert two_nodes["after_kill"].get(6) is True and not two_nodes["after_kill"].get(9), two_nodes["after_kill"]
    for node, rc in zip(two_nodes["retry"], two_nodes["retry_rc"]):
        assert rc == 0, f"{node.label}:\n{node.tail()}"
    assert "resumed at step 6" in two_nodes["retry"][0].tail(200_000)
    assert published(two_nodes["root"]) == {6: True, 9: True, 12: True}

    assert differing_params(workdir / "final-reference.pt", workdir / "final-run2.pt") == []
    # Every step trained on the same samples as the uninterrupted run (rank order included).
    assert chain([(workdir / "samples-run1", 6), (workdir / "samples-run2", STEPS)]) == read_samples(
        workdir / "samples-reference"
    )


def test_the_two_node_run_resumes_on_one_node(workdir: Path, two_nodes: dict) -> None:
    root = two_nodes["root"]
    node = start(
        "resized",
        workdir,
        torchrun("--standalone", "--nproc-per-node=1", *train_args(workdir, "resized", root, STEPS + 3, 2 * BATCH)),
        job_env(workdir / "staging-resized"),
    )
    assert node.wait(JOB_TIMEOUT) == 0, node.tail()
    assert f"resumed at step {STEPS}" in node.tail(200_000)
    steps = chain(
        [(workdir / "samples-run1", 6), (workdir / "samples-run2", STEPS), (workdir / "samples-resized", STEPS + 3)]
    )
    assert sorted(steps) == list(range(1, STEPS + 4))
    consumed = [p for s in sorted(steps) for p in steps[s]]
    state = data_state(root / f"step_{STEPS + 3:08d}")
    assert exactly_once_problems(consumed, state, STEPS + 3, 2 * BATCH) == []


def test_sigterm_saves_the_step_reached_and_the_retry_continues_the_mlflow_run(
    workdir: Path,
    mlflow_server: str,
) -> None:
    root = workdir / "vol-preempted"
    big = ["--shards", "64", "--samples-per-shard", "256"]  # one epoch outlasts the job
    env = job_env(workdir / "staging-preempted", MLFLOW_TRACKING_URI=mlflow_server)
    launch = torchrun("--standalone", "--nproc-per-node=2", *train_args(workdir, "preempt1", root, 100_000), *big)
    node = start("preempt1", workdir, launch, env)
    wait_for(lambda: (root / "latest").exists(), JOB_TIMEOUT, f"a first checkpoint ({node.log})")
    node.proc.send_signal(signal.SIGTERM)  # to the agent, as a scheduler does; torchrun passes it on
    assert node.wait(JOB_TIMEOUT) != 0
    stopped = json.loads((root / "latest").read_text())["step"]
    log = node.tail(500_000)
    assert f"final save of step {stopped} published" in log, log[-3000:]
    # Every rank stopped at that step: nothing trained after the final checkpoint is lost.
    assert max(read_samples(workdir / "samples-preempt1")) == stopped
    assert published(root)[stopped]

    launch = torchrun("--standalone", "--nproc-per-node=2", *train_args(workdir, "preempt2", root, stopped + 3), *big)
    retry = start("preempt2", workdir, launch, env)
    assert retry.wait(JOB_TIMEOUT) == 0, retry.tail()
    assert f"resumed at step {stopped}" in retry.tail(500_000)

    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    loss_steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(loss_steps) == list(range(3, stopped + 4, 3))  # --log-every 3, from both jobs
    saved = {m.step for m in client.get_metric_history(run.info.run_id, "checkpoint/publish_s")}
    assert stopped in saved and max(saved) > stopped  # the final save, and the retry's saves


def test_sigterm_to_every_process_of_a_node_stops_the_job_at_one_step_and_resumes_bit_identical(
    workdir: Path, reference_two_workers: Node
) -> None:
    root = workdir / "vol-sigterm-all"
    hold = workdir / "hold-sigterm-all"
    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    args = [*train_args(workdir, "term1", root), *TWO_WORKERS]
    node0 = start(
        "term1-node0",
        workdir,
        torchrun(*two_node_launch(port, rdzv, 0), SHUTDOWN_TIMEOUT, *args),
        job_env(workdir / "staging-term-node0"),
    )
    node1 = start(
        "term1-node1",
        workdir,
        torchrun(*two_node_launch(port, rdzv, 1), SHUTDOWN_TIMEOUT, *args),
        held_env(workdir / "staging-term-node1", hold, "step_00000003"),
    )
    # Node 1's upload of step 3 is held: both ranks train on to step 6, where the next save waits for
    # it. The stop lands there, so the first step boundary that sees it is step 7.
    wait_for(lambda: any(hold.glob("upload-started-*")), JOB_TIMEOUT, f"node 1 to upload step 3 ({node1.log})")
    wait_for(
        lambda: "rank 0: step 6 loss" in node0.tail() and "rank 1: step 6 loss" in node1.tail(),
        JOB_TIMEOUT,
        "both ranks to train step 6",
    )
    signalled = node1.signal_every_process(signal.SIGTERM)
    assert len(signalled) >= 4, signalled  # the agent, its rank and the rank's two workers
    (hold / "hold").unlink()
    rc0, rc1 = node0.wait(JOB_TIMEOUT), node1.wait(JOB_TIMEOUT)
    logs = node0.tail(500_000) + node1.tail(500_000)
    assert "is killed by signal" not in logs, logs[-3000:]  # no DataLoader worker died of the notice
    stopped = json.loads((root / "latest").read_text())["step"]
    assert f"final save of step {stopped} published" in logs, logs[-3000:]
    assert published(root).get(stopped) is True
    assert max(read_samples(workdir / "samples-term1")) == stopped  # every rank stopped there
    assert stopped == 7, stopped
    # What the launcher and the scheduler see: the ranks exit 143, each torchrun agent exits 1 (the
    # one that got the signal re-raises it as SignalException, the other reports its ranks failed).
    assert (rc0, rc1) == (1, 1)

    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    args = [*train_args(workdir, "term2", root), *TWO_WORKERS]
    retry = [
        start(
            f"term2-node{n}",
            workdir,
            torchrun(*two_node_launch(port, rdzv, n), *args),
            job_env(workdir / f"staging-term-node{n}"),
        )
        for n in (0, 1)
    ]
    for node in retry:
        assert node.wait(JOB_TIMEOUT) == 0, f"{node.label}:\n{node.tail()}"
    assert f"resumed at step {stopped}" in retry[0].tail(200_000)
    assert differing_params(workdir / "final-reference-w2.pt", workdir / "final-term2.pt") == []
    assert chain([(workdir / "samples-term1", stopped), (workdir / "samples-term2", STEPS)]) == read_samples(
        workdir / "samples-reference-w2"
    )
