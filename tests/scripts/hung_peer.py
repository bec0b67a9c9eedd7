"""Run under torchrun (two ranks): one rank (the victim) stops answering at a chosen point, and the
other (the survivor) calls the checkpoint manager's operations, each of which must fail with
PeerTimeoutError within about the timeout. Used by tests/integration/test_hung_peer.py, whose
harness SIGSTOPs the victim (and, for a node, its torchrun agent) once it has written
``ready-<rank>``.

Usage: hung_peer.py WORKDIR SCENARIO

Scenarios (``SCENARIOS``; ``process`` saves with ``Staging(mode="process")``; ``node`` passes the
manager a ``process_group`` made by ``new_group()``, whose timeout is torch's 30-minute default,
as the README's loop does): the group's timeout (``init_process_group(timeout=...)``), the
manager's own (``CheckpointManager(timeout=...)``, None: the group's), the victim's rank and the
survivor's operations, in order. Each operation has a manager of its own under
``WORKDIR/root-<op>`` (a timed-out manager's groups are unusable, the next operation's are not),
set up before the victim stops: its groups created, step 1 published, one ``should_save``
decision handed over. Operations:

- ``load``: ``load(step=1)``; the victim takes part in the lookup of step 1, then stops inside
  DCP's load, before its collectives;
- ``preemption``, ``latest``: the call itself;
- ``should_save``: steps 1 to PROBE_STEPS of an ``EverySeconds`` policy, whose re-decision at the
  last one the survivor (not rank 0) waits for in the store;
- ``save``: an async ``save(2)`` whose background collectives wait for the victim, then ``wait()``;
- ``again``: ``preemption_requested()`` of the manager whose save timed out (no manager of its own);
- ``final``: an async ``save(2)`` whose background collectives wait for the victim, then
  ``save_final(3)`` (a preemption's last save), which must raise, not skip or hang;
- ``exit``: an async ``save(2)`` in flight, then ``preemption_requested()``, its error not caught:
  the process must exit.

Each finished operation appends a JSON line to ``WORKDIR/results-<rank>.jsonl``: the operation,
the error's class and message, and the seconds it took; ``exit`` appends its start first.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops import manager as manager_module
from uc_checkpoint.ops.interval import EverySeconds
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.schedule import PROBE_STEPS

warnings.filterwarnings("ignore")

#: name -> (group timeout s, manager timeout s or None, victim rank, survivor's operations)
SCENARIOS: dict[str, tuple[float, float | None, int, list[str]]] = {
    "rank": (3.0, None, 1, ["load", "preemption", "latest", "save", "again", "final", "exit"]),
    "manager-timeout": (120.0, 3.0, 0, ["should_save", "latest", "preemption"]),
    "node": (3.0, None, 1, ["exit"]),
    "process": (3.0, None, 1, ["save", "exit"]),  # Staging(mode="process")
}


def state(step: int) -> dict[str, Any]:
    rank = dist.get_rank()
    return {f"rank{rank}": torch.full((1024,), float(step * 10 + rank)), "step": step}


def stop_here(workdir: Path) -> None:
    """Announce this rank as ready to be stopped, then never return (the harness SIGSTOPs it)."""
    (workdir / f"ready-{dist.get_rank()}").write_text(str(os.getpid()))
    threading.Event().wait()


def record(workdir: Path, **fields: Any) -> None:
    with open(workdir / f"results-{dist.get_rank()}.jsonl", "a") as out:
        out.write(json.dumps(fields) + "\n")


def timed(workdir: Path, op: str, call: Callable[[], object]) -> None:
    started = time.monotonic()
    try:
        call()
        record(workdir, op=op, error=None, message="returned", elapsed_s=time.monotonic() - started)
    except BaseException as exc:  # noqa: BLE001 - recorded for the harness
        record(workdir, op=op, error=type(exc).__name__, message=str(exc), elapsed_s=time.monotonic() - started)


def should_save_until_redecided(m: CheckpointManager) -> None:
    for step in range(1, PROBE_STEPS + 1):
        m.should_save(step)


def main() -> int:
    workdir, scenario = Path(sys.argv[1]), sys.argv[2]
    group_s, manager_s, victim, ops = SCENARIOS[scenario]
    dist.init_process_group("gloo", timeout=timedelta(seconds=group_s))
    rank = dist.get_rank()
    (workdir / f"pid-{rank}").write_text(str(os.getpid()))
    own_group = dist.new_group(backend="gloo") if scenario == "node" else None
    managers: dict[str, CheckpointManager] = {}
    for op in ops:
        if op == "again":
            continue
        policy = EverySeconds(3600.0) if op == "should_save" else None
        m = CheckpointManager(
            str(workdir / f"root-{op}"),
            keep_last=None,
            timeout=manager_s,
            save_interval=policy,
            process_group=own_group,
            staging=Staging(mode="process" if scenario == "process" else "thread"),
        )
        assert m.preemption_requested() is False  # creates the manager's groups
        m.save(1, state(1))
        m.wait()
        if policy is not None:
            assert m.should_save(0) is False  # decision 0 handed over: re-decide after PROBE_STEPS
        managers[op] = m
    dist.barrier()

    if rank == victim:
        if ops[0] == "load":  # take part in load's lookup, stop before DCP's collectives

            def held_load(*args: Any, **kwargs: Any) -> None:
                stop_here(workdir)

            manager_module.dcp.load = held_load  # type: ignore[assignment]
            managers["load"].load(state(0), step=1)
        stop_here(workdir)

    for op in ops:
        m = managers["save" if op == "again" else op]
        if op == "load":
            timed(workdir, op, partial(m.load, state(0), step=1))
        elif op in ("preemption", "again"):
            timed(workdir, op, m.preemption_requested)
        elif op == "latest":
            timed(workdir, op, m.latest)
        elif op == "should_save":
            timed(workdir, op, partial(should_save_until_redecided, m))
        elif op == "save":
            m.save(2, state(2))
            timed(workdir, op, m.wait)
        elif op == "final":
            m.save(2, state(2))
            timed(workdir, op, partial(m.save_final, 3, state(3)))
        elif op == "exit":
            m.save(2, state(2))
            record(workdir, op=op, started=time.time())
            m.preemption_requested()  # raises; the process must exit with the save in flight
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
