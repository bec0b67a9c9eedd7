"""A hung peer fails the job within the job's timeout: real torchrun jobs whose victim rank (or
whole "node": its torchrun agent and its rank) is SIGSTOPped, so it neither answers nor closes its
connections, as a frozen process or a network partition does.

The survivor calls each operation of the checkpoint manager that waits for other ranks (worker:
tests/scripts/hung_peer.py) and must get a PeerTimeoutError naming the operation and the peer
within the timeout plus a generous slack; a save in flight then publishes nothing (in DCP's
THREAD and PROCESS modes), and a process whose save is stuck in a background collective still
exits. The timeout is the job's (``init_process_group``'s), also for a manager given a group made
by ``new_group()`` (torch's 30 minutes), unless the manager has a shorter one of its own. Timeouts
are 3 s so that each job takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scripts.example_jobs import Node, free_port, job_env, start, torchrun, two_node_launch, wait_for

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "hung_peer.py"
TIMEOUT_S = 3.0  # the worker's timeout in every scenario: the group's, or the manager's own
SLACK_S = 20.0  # a loaded 2-core machine; far below the 30-minute default the groups had
START_S = 120.0  # seconds the jobs may take to reach the point where the victim stops


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not yet reaped by its agent counts)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] == "Z"


def results(workdir: Path, rank: int) -> dict[str, dict]:
    path = workdir / f"results-{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {rec["op"]: rec for rec in map(json.loads, lines)}


class Job:
    """Launched nodes, the processes the harness stopped, and a teardown that ends them all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.nodes: list[Node] = []
        self.stopped: list[int] = []

    def launch(self, label: str, launch: list[str], scenario: str) -> Node:
        env = job_env(self.workdir / f"staging-{label}")
        node = start(label, self.workdir, torchrun(*launch, str(WORKER), str(self.workdir), scenario), env)
        self.nodes.append(node)
        return node

    def stop_victim(self, rank: int, *also: int) -> None:
        """SIGSTOP the rank once it is ready (and ``also``: its agent)."""
        ready = self.workdir / f"ready-{rank}"
        logs = ", ".join(str(n.log) for n in self.nodes)
        wait_for(lambda: ready.exists() and ready.read_text(), START_S, f"rank {rank} to be ready ({logs})")
        for pid in (int(ready.read_text()), *also):
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)

    def pid(self, rank: int) -> int:
        return int((self.workdir / f"pid-{rank}").read_text())

    def logs(self) -> str:
        return "\n".join(f"--- {n.label}:\n{n.tail()}" for n in self.nodes)

    def close(self) -> None:
        for pid in self.stopped:  # SIGKILL ends a stopped process too; SIGCONT lets it be reaped
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for node in self.nodes:
            if node.proc.poll() is None:
                node.kill()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    job = Job(tmp_path)
    try:
        yield job
    finally:
        job.close()


def assert_peer_timeout(rec: dict, operation: str, peer: int, logs: str) -> None:
    assert rec["error"] == "PeerTimeoutError", (rec, logs[-4000:])
    assert operation in rec["message"] and f"rank {peer} did not take part" in rec["message"], rec
    assert f"within the timeout of {TIMEOUT_S:g} s" in rec["message"], rec  # the group's or the manager's
    assert rec["elapsed_s"] < TIMEOUT_S + SLACK_S, rec


def assert_exits(job: Job, rank: int, logs_of: Node) -> None:
    """Rank ``rank`` started its last operation (a save in flight, then an agreement whose error it
    does not catch) and its process exits within the bound."""
    wait_for(lambda: "exit" in results(job.workdir, rank), START_S, f"rank {rank}'s last operation ({logs_of.log})")
    pid = job.pid(rank)
    wait_for(lambda: gone(pid), TIMEOUT_S + SLACK_S, f"rank {rank} (pid {pid}) to exit\n{job.logs()[-4000:]}")
    assert "PeerTimeoutError" in logs_of.tail(200_000), logs_of.tail()


def test_a_hung_rank_fails_each_agreement_and_a_save_in_flight(job: Job) -> None:
    node = job.launch("rank", ["--standalone", "--nproc-per-node=2"], "rank")
    job.stop_victim(1)
    assert_exits(job, 0, node)
    got = results(job.workdir, 0)
    logs = job.logs()
    assert_peer_timeout(got["load"], "load step 1 from", 1, logs)
    assert_peer_timeout(got["preemption"], "agree on preemption", 1, logs)
    assert_peer_timeout(got["latest"], "find the latest checkpoint", 1, logs)
    assert_peer_timeout(got["save"], "save step 2 to", 1, logs)
    # The manager whose save timed out refuses its next agreement at once, with the first error.
    assert got["again"]["error"] == "PeerTimeoutError", got["again"]
    assert "cannot agree on preemption" in got["again"]["message"], got["again"]
    assert "lost contact earlier: rank 0: cannot save step 2" in got["again"]["message"], got["again"]
    # A preemption's final save behind a save in flight raises the peer's timeout (not a skip).
    assert_peer_timeout(got["final"], "save step 2 to", 1, logs)
    assert not (job.workdir / "root-final" / "step_00000003" / ".metadata").exists()
    # The saves in flight published nothing; step 1, saved before, stays published.
    for op in ("save", "final", "exit"):
        assert not (job.workdir / f"root-{op}" / "step_00000002" / ".metadata").exists()
        assert (job.workdir / f"root-{op}" / "step_00000001" / ".metadata").exists()


def test_a_save_in_dcps_checkpoint_process_fails_too(job: Job) -> None:
    # Staging(mode="process"): the save's collectives run in DCP's own process and process group.
    node = job.launch("process", ["--standalone", "--nproc-per-node=2"], "process")
    job.stop_victim(1)
    assert_exits(job, 0, node)
    assert_peer_timeout(results(job.workdir, 0)["save"], "save step 2 to", 1, job.logs())
    for op in ("save", "exit"):
        assert not (job.workdir / f"root-{op}" / "step_00000002" / ".metadata").exists()
        assert (job.workdir / f"root-{op}" / "step_00000001" / ".metadata").exists()


def test_the_managers_timeout_applies_when_shorter_than_the_groups(job: Job) -> None:
    # The group's timeout is 120 s; the manager's own, 3 s. The victim is rank 0, which decides.
    job.launch("manager", ["--standalone", "--nproc-per-node=2"], "manager-timeout")
    job.stop_victim(0)
    wait_for(lambda: len(results(job.workdir, 1)) == 3, START_S, f"rank 1's operations\n{job.logs()[-4000:]}")
    got = results(job.workdir, 1)
    logs = job.logs()
    assert_peer_timeout(got["should_save"], "whether to save at step 5", 0, logs)
    assert_peer_timeout(got["latest"], "find the latest checkpoint", 0, logs)
    assert_peer_timeout(got["preemption"], "agree on preemption", 0, logs)


def test_a_stopped_node_lets_the_other_node_exit(job: Job) -> None:
    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    node0 = job.launch("node0", two_node_launch(port, rdzv, 0), "node")
    node1 = job.launch("node1", two_node_launch(port, rdzv, 1), "node")
    job.stop_victim(1, node1.proc.pid)  # the node's agent and its rank
    # The manager's process_group is a new_group() of torch's 30 minutes: the job's 3 s apply.
    # Node 0's rank, with a save in flight, fails its next agreement and exits; then its agent.
    assert node0.wait(TIMEOUT_S + SLACK_S) != 0, node0.tail()
    assert gone(job.pid(0))
    assert "exit" in results(job.workdir, 0), job.logs()[-4000:]
    log = node0.tail(200_000)
    assert "PeerTimeoutError: rank 0: cannot agree on preemption" in log and "rank 1 did not take part" in log, log
    assert not (job.workdir / "root-exit" / "step_00000002" / ".metadata").exists()
