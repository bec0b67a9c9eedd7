"""Helpers of the tests that run the example job (examples/train_fsdp.py) as a real job:
torchrun agents ("nodes") started as process groups of their own, SIGKILLed as a whole node, and
the checks that follow (final parameters, samples trained per step, the data state left in the
last checkpoint). Used by tests/integration/test_examples_multinode.py and
tests/integration/test_databricks_bundle.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from uc_checkpoint.demo.run import kill_process_tree

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_fsdp.py"
HOLD_HOOK = Path(__file__).resolve().parent / "upload_hold"  # sitecustomize.py: holds one checkpoint's uploads

# A small job: 8 shards x 64 samples (512 per epoch); global batch 8; a checkpoint every 3 steps.
SHARDS, PER_SHARD = 8, 64
TRAIN_ARGS = ["--shards", str(SHARDS), "--samples-per-shard", str(PER_SHARD), "--data-workers", "1"]
TRAIN_ARGS += ["--save-every", "3", "--log-every", "3", "--timeout-s", "60"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(staging: Path, **extra: str) -> dict[str, str]:
    """The environment of one node: its own staging directory, one intra-op thread (bit-exact
    results), no MLflow of the caller's, and faulthandler on (a rank killed by a signal leaves its
    stack in the log)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=str(REPO),
        UC_CHECKPOINT_STAGING_DIR=str(staging),
    )
    env.update(extra)
    return env


def held_env(staging: Path, hold_dir: Path, location: str) -> dict[str, str]:
    """:func:`job_env` plus the upload hold (tests/scripts/upload_hold) for ``location``."""
    hold_dir.mkdir(parents=True, exist_ok=True)
    (hold_dir / "hold").touch()
    return job_env(
        staging,
        PYTHONPATH=f"{HOLD_HOOK}{os.pathsep}{REPO}",
        UC_TEST_HOLD_UPLOAD=location,
        UC_TEST_HOLD_DIR=str(hold_dir),
    )


@dataclass
class Node:
    """One launched process tree (a torchrun agent and its ranks, or command.sh): a node."""

    label: str
    proc: subprocess.Popen[bytes]
    log: Path

    def wait(self, timeout: float) -> int:
        """Its exit code; on timeout the whole tree is killed and AssertionError raised."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.label} still ran after {timeout} s; log {self.log}:\n{self.tail()}") from None

    def kill(self) -> None:
        """SIGKILL the agent and every rank at once (the ranks run in sessions of their own)."""
        kill_process_tree(self.proc.pid)
        self.proc.wait()

    def signal_every_process(self, sig: int) -> list[int]:
        """Send ``sig`` to the agent, every rank and every DataLoader worker at once, as Slurm, a
        systemd or cgroup stop or a pod termination do (torchrun's ranks run in sessions of their
        own, so ``kill -- -<pgid>`` of the agent's group would reach the agent alone). Returns the
        pids signalled."""
        return kill_process_tree(self.proc.pid, sig)

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def start(label: str, workdir: Path, cmd: list[str], env: dict[str, str]) -> Node:
    log = workdir / f"log-{label}.txt"
    out = open(log, "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    out.close()
    return Node(label, proc, log)


def torchrun(*launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch]


def two_node_launch(port: int, rdzv_id: str, node: int, nproc: int = 1) -> list[str]:
    """torchrun's arguments for node ``node`` of two meeting at a c10d rendezvous on 127.0.0.1.
    Node 0 hosts the rendezvous store, as the node at MASTER_ADDR does in a real job (on one
    machine either agent could, and which one decides how long the other takes to fail)."""
    return [
        "--nnodes=2",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
    ]


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``cond`` every 50 ms; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def read_samples(prefix: Path) -> dict[int, list[tuple[int, int]]]:
    """(shard, sample) pairs trained on per step, all ranks in rank order, from a run's logs
    (``<prefix>-rank<r>.jsonl``, written by the example's ``--samples-log``)."""
    per_step: dict[int, list[tuple[int, int]]] = {}
    logs = sorted(prefix.parent.glob(f"{prefix.name}-rank*.jsonl"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    for path in logs:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            per_step.setdefault(rec["step"], []).extend((a, b) for a, b in rec["samples"])
    return per_step


def chain(runs: list[tuple[Path, int]]) -> dict[int, list[tuple[int, int]]]:
    """Samples per step of interrupted and resumed runs: each ``(samples prefix, last step that
    counts)``, the last step being where its successor resumed (later steps were trained again)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for prefix, upto in runs:
        out.update({s: v for s, v in read_samples(prefix).items() if s <= upto})
    return out


def data_state(checkpoint: Path) -> dict:
    """The data tracker state a checkpoint holds (its ``remaining`` work, epoch, ...)."""
    import torch.distributed.checkpoint as dcp

    from uc_checkpoint import UCVolumeReader

    sd = {"data": {"global_state": ""}}
    dcp.load(sd, storage_reader=UCVolumeReader(str(checkpoint)), no_dist=True)
    return json.loads(sd["data"]["global_state"])


def exactly_once_problems(consumed: list[tuple[int, int]], state: dict, steps: int, global_batch: int) -> list[str]:
    """What is wrong with ``consumed`` (every sample trained on, in one epoch) against the last
    checkpoint's data ``state``: repeats, samples still listed as remaining, samples lost."""
    remaining = {(sh, j) for sh, a, b in state["remaining"] for j in range(a, b)}
    counts = Counter(consumed)
    problems = [f"sample {p} trained on {n} times" for p, n in counts.items() if n > 1][:5]
    if len(consumed) != steps * global_batch:
        problems.append(f"{len(consumed)} samples trained on, expected {steps} steps x {global_batch}")
    if set(counts) & remaining:
        problems.append(f"{len(set(counts) & remaining)} samples trained on are still listed as remaining")
    if len(counts) + len(remaining) != SHARDS * PER_SHARD:
        problems.append(f"{SHARDS * PER_SHARD - len(counts) - len(remaining)} samples of the epoch were lost")
    if state["epoch"] != 0:
        problems.append(f"the runs crossed into epoch {state['epoch']}")
    return problems


def differing_params(a: Path, b: Path) -> list[str]:
    """Names of the tensors that differ between two ``--final`` files (empty: bit-identical)."""
    ref = torch.load(a, weights_only=True)
    got = torch.load(b, weights_only=True)
    if ref.keys() != got.keys():
        return [f"keys differ: {sorted(ref.keys() ^ got.keys())}"]
    return [k for k in ref if not torch.equal(ref[k], got[k])]
