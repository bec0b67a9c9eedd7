"""The resume-after-preemption demo (``uc-checkpoint demo``).

1. Packs the standard library's ``.py`` sources into byte-token shards.
2. Trains the reference: the whole run, two ranks under ``torchrun``, no checkpoints.
3. Trains again with ``dcp.async_save`` + :class:`UCVolumeWriter` every ``--save-every`` steps, and
   SIGKILLs the whole job (torchrun and both ranks) right after a checkpoint's upload has started;
   checks that the killed checkpoint was not published; restarts; the job resumes from the newest
   published checkpoint and trains to the end.
4. PASS when the final parameters are bit-identical to the reference, else FAIL (exit code 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoints import list_checkpoints
from ..volumes import open_volume


@dataclass
class Job:
    """One torchrun launch and what its events said."""

    label: str
    proc: subprocess.Popen[bytes]
    events_path: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0

    def poll_events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        with open(self.events_path, encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.events.extend(new)
        return new


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="uc-checkpoint demo", description=__doc__.splitlines()[0])
    p.add_argument("--volume", help="checkpoint root (default: <workdir>/volume, a local directory)")
    p.add_argument("--workdir", help="data, logs and the default volume (default: a new temp dir)")
    p.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    p.add_argument("--save-every", type=int, default=6, help="checkpoint interval in steps (default 6)")
    p.add_argument("--kill-at", type=int, default=None, help="kill while the checkpoint of this step uploads (default: the 3rd)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--model", choices=("demo", "gpt2-small"), default="demo", help="demo (~22 MB state) or gpt2-small (124M params)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--async-mode", choices=("thread", "process"), default="thread")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per training job")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_demo(args)


def say(msg: str) -> None:
    print(msg, flush=True)


def launch(label: str, workdir: Path, data: Path, args: argparse.Namespace, volume: str | None, final: Path) -> Job:
    events = workdir / f"events-{label}.jsonl"
    log = open(workdir / f"log-{label}.txt", "ab")  # noqa: SIM115 - owned by the child
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        "-m", "uc_checkpoint.demo.train",
        "--data", str(data), "--events", str(events), "--final", str(final),
        "--steps", str(args.steps), "--save-every", str(args.save_every), "--model", args.model,
        "--batch-size", str(args.batch_size), "--async-mode", args.async_mode,
        "--staging-dir", str(workdir / "staging"),
    ]
    if volume is not None:
        cmd += ["--volume", volume]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Job(label, proc, events)


def _process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (from /proc). torchrun starts each rank in a session of its
    own, so killing torchrun's process group alone would leave the ranks running."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_job(job: Job) -> None:
    """SIGKILL torchrun and every rank at once, as a preemption would."""
    for pid in _process_tree(job.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.proc.wait()


def follow(job: Job, deadline: float, kill_at: int | None = None) -> str:
    """Print the job's progress until it exits; with ``kill_at``, SIGKILL it as soon as that step's
    checkpoint upload has started. Returns ``"done"``, ``"killed"`` or ``"failed"``."""
    while True:
        for ev in job.poll_events():
            kind = ev["event"]
            if kind == "start":
                say(f"  [{job.label}] {ev['world_size']} ranks, {ev['params']:,} parameters, starting at step {ev['step']}")
            elif kind == "resume":
                d = ev["data"]
                say(f"  [{job.label}] resumed from {ev['location']} at step {ev['step']} (epoch {d['epoch']}, "
                    f"sample {d['offset']}) in {ev['load_s']:.2f} s")
            elif kind == "step" and (ev["step"] % 5 == 0 or ev["step"] == 1):
                say(f"  [{job.label}] step {ev['step']:4d}  loss {ev['loss']:.4f}")
            elif kind == "save_start":
                say(f"  [{job.label}] checkpoint step {ev['step']}: async_save returned after {ev['blocked_s']:.3f} s, uploading")
                if kill_at is not None and ev["step"] == kill_at:
                    kill_job(job)
                    say(f"  [{job.label}] SIGKILL (preemption) while checkpoint step {ev['step']} was uploading")
                    return "killed"
            elif kind == "save_done":
                state = "published" if ev["ok"] else f"FAILED {ev['error']}"
                say(f"  [{job.label}] checkpoint step {ev['step']}: {state} after {ev['publish_s']:.3f} s")
        if job.proc.poll() is not None:
            job.poll_events()
            return "done" if job.proc.returncode == 0 else "failed"
        if time.time() > deadline:
            kill_job(job)
            return "failed"
        time.sleep(0.2)


def compare(ref_path: Path, got_path: Path) -> list[str]:
    import torch

    ref = torch.load(ref_path, map_location="cpu", weights_only=True)
    got = torch.load(got_path, map_location="cpu", weights_only=True)
    problems = [f"missing {k}" for k in ref.keys() - got.keys()]
    for k in sorted(ref.keys() & got.keys()):
        if not torch.equal(ref[k], got[k]):
            problems.append(f"{k}: max |diff| {float((ref[k].float() - got[k].float()).abs().max()):.3g}")
    return problems


def run_demo(args: argparse.Namespace) -> int:
    from .data import build_shards

    if args.save_every < 1 or args.steps < 3 * args.save_every:
        raise SystemExit("uc-checkpoint demo: --steps must be at least 3 x --save-every")
    kill_at = args.kill_at if args.kill_at is not None else 3 * args.save_every
    if kill_at % args.save_every or not args.save_every <= kill_at < args.steps:
        raise SystemExit(f"uc-checkpoint demo: --kill-at {kill_at} must be a checkpoint step before --steps")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="uc-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    volume = args.volume or str(workdir / "volume")
    vol = open_volume(volume)
    if vol.list_files():
        raise SystemExit(f"uc-checkpoint demo: the volume {volume} is not empty; give a new location")
    deadline_each = args.timeout
    started = time.time()

    say(f"uc_checkpoint demo: {args.nproc} ranks, {args.steps} steps, checkpoint every {args.save_every}, "
        f"preemption at step {kill_at}")
    say(f"  workdir {workdir}\n  volume  {volume}")
    shards = build_shards(workdir / "data")
    say(f"  data: {len(shards.shards)} shards, {shards.total_bytes:,} bytes of Python standard library source")

    say("1/3 reference run, uninterrupted, no checkpoints")
    ref_final = workdir / "final-reference.pt"
    job = launch("reference", workdir, shards.root, args, None, ref_final)
    if follow(job, time.time() + deadline_each) != "done":
        say(f"FAIL: the reference run failed; see {workdir}/log-reference.txt")
        return 1

    say("2/3 run with checkpoints, preempted while a checkpoint uploads")
    final = workdir / "final-resumed.pt"
    attempts, outcome, killed_in_flight = 0, "", False
    resumes: list[dict[str, Any]] = []
    jobs: list[Job] = []
    unpublished: set[tuple[str, int]] = set()  # (run, step) killed mid-upload and checked
    while True:
        attempts += 1
        job = launch(f"run{attempts}", workdir, shards.root, args, volume, final)
        jobs.append(job)
        outcome = follow(job, time.time() + deadline_each, None if killed_in_flight else kill_at)
        resumes += [e for e in job.events if e["event"] == "resume"]
        if outcome == "killed":
            published = {step: pub for step, _, pub in list_checkpoints(vol)}
            if published.get(kill_at):
                say(f"  the kill came after checkpoint step {kill_at} was published; killing again at the next one")
                kill_at += args.save_every
                if kill_at >= args.steps:
                    say("FAIL: could not kill during an upload")
                    return 1
            else:
                killed_in_flight = True
                unpublished.add((job.label, kill_at))
                say(f"  checkpoint step {kill_at} has no .metadata: not published, as it must be")
            say("3/3 restart: resume from the newest published checkpoint")
            continue
        break
    if outcome != "done":
        say(f"FAIL: the training job failed; see {workdir}/log-{job.label}.txt")
        return 1

    problems = compare(ref_final, final)
    print_table(jobs, vol, resumes, unpublished)
    elapsed = time.time() - started
    if not killed_in_flight or not resumes:
        say(f"FAIL: no preemption during an upload was exercised ({elapsed:.0f} s)")
        return 1
    if problems:
        say(f"FAIL: final parameters differ from the uninterrupted run: {problems[:5]} ({elapsed:.0f} s)")
        return 1
    say(f"PASS: final parameters are bit-identical to the uninterrupted run ({elapsed:.0f} s, workdir {workdir})")
    if not args.workdir:
        shutil.rmtree(workdir / "staging", ignore_errors=True)
    return 0


def print_table(jobs: list[Job], vol: Any, resumes: list[dict[str, Any]], unpublished: set[tuple[str, int]]) -> None:
    sizes = {}
    for step, name, _published in list_checkpoints(vol):
        sizes[step] = sum(s for s in vol.child(name).list_files().values() if s > 0)
    say("")
    say(f"{'run':6} {'step':>5} {'size MB':>8} {'blocked s':>10} {'to .metadata s':>15} {'MB/s':>7}  state")
    for job in jobs:
        starts = {e["step"]: e for e in job.events if e["event"] == "save_start"}
        dones = {e["step"]: e for e in job.events if e["event"] == "save_done"}
        for step, ev in sorted(starts.items()):
            size = sizes.get(step, 0)
            done = dones.get(step)
            publish = f"{done['publish_s']:.3f}" if done else "-"
            rate = f"{size / 1e6 / done['publish_s']:.1f}" if done and done["publish_s"] > 0 else "-"
            if done:
                state = "published" if done["ok"] else "FAILED"
            elif (job.label, step) in unpublished:
                state = "killed during upload: no .metadata (checked)"
            else:
                state = "killed during upload"
            say(f"{job.label:6} {step:5d} {size / 1e6:8.2f} {ev['blocked_s']:10.3f} {publish:>15} {rate:>7}  {state}")
    for ev in resumes:
        d = ev["data"]
        say(f"resume: step {ev['step']} from {ev['location']} (epoch {d['epoch']}, sample offset {d['offset']}, "
            f"{d['samples']} samples consumed), load {ev['load_s']:.2f} s")
    say("")


if __name__ == "__main__":
    raise SystemExit(main())
