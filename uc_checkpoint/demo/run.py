"""The resume-after-preemption demo (``uc-checkpoint demo``).

1. Packs the standard library's ``.py`` sources into byte-token shards; the data pipeline is a
   :class:`~uc_checkpoint.data.loading.TrackedDataLoader` (2 workers per rank by default) whose
   tracker state is part of every checkpoint.
2. Trains the reference: the whole run, two ranks under ``torchrun``, no checkpoints.
3. Trains again with ``dcp.async_save`` + :class:`UCVolumeWriter` every ``--save-every`` steps, and
   SIGKILLs the whole job (torchrun and both ranks) right after a checkpoint's upload has started;
   checks that the killed checkpoint was not published; restarts; the job resumes from the newest
   published checkpoint (printing which shards the data pipeline skips and where each worker seeks)
   and trains to the end.
4. Resumes the finished run on ``--resize-to`` ranks (default 1) for ``--save-every`` more steps: DCP
   reshards the model, the tracker the remaining data.
5. PASS when the final parameters of step 3 are bit-identical to the reference and, across all runs,
   every sample of the epoch was trained on exactly once or is still listed as remaining (checked
   sample by sample from each rank's log); else FAIL (exit code 1).

Each job's output is kept in the work directory: torchrun's in ``log-<run>.txt`` and each rank's
stdout and stderr apart, under ``ranks-<run>/`` (:func:`rank_log_dir`); the ranks run with Python's
``faulthandler`` on, so a rank killed by a signal such as SIGSEGV leaves its threads' stacks in its
``stderr.log``. A FAIL names those files.
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

from uc_checkpoint.format.layout import MANIFEST_ATTR
from uc_checkpoint.format.manifest import entries_of
from uc_checkpoint.ops import catalog
from uc_checkpoint.volumes import open_volume

DEMO_SHARDS = 24
"""Shards the demo cuts its corpus into."""


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
    p.add_argument(
        "--kill-at", type=int, default=None, help="kill while the checkpoint of this step uploads (default: the 3rd)"
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--model",
        choices=("demo", "gpt2-small"),
        default="demo",
        help="demo (~22 MB state) or gpt2-small (124M params)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--async-mode", choices=("thread", "process"), default="thread")
    p.add_argument("--data-workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    p.add_argument(
        "--resize-to",
        type=int,
        default=1,
        help="ranks of the last phase, which resumes the finished run on another world size (default 1; 0 skips it)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per training job")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_demo(args)


def say(msg: str) -> None:
    print(msg, flush=True)


def rank_log_dir(workdir: Path, label: str) -> Path:
    """Where torchrun keeps each rank's output of the job ``label``:
    ``<dir>/<run id>_<random>/attempt_0/<local rank>/stdout.log`` and ``stderr.log`` (the layout
    of ``torch.distributed.elastic``)."""
    return workdir / f"ranks-{label}"


def job_logs(workdir: Path, label: str) -> str:
    """The logs of the job ``label``, for a failure message: torchrun's log and every rank's
    ``stderr.log`` (or, when torchrun made none, the directory they would be in)."""
    ranks = sorted(rank_log_dir(workdir, label).glob("*/attempt_*/*/stderr.log"))
    where = ", ".join(str(p) for p in ranks) if ranks else f"none under {rank_log_dir(workdir, label)}"
    return f"{workdir / f'log-{label}.txt'}; each rank's stderr: {where}"


def start_torchrun(label: str, workdir: Path, nproc: int, target: list[str]) -> Job:
    """Start ``torchrun --standalone`` with ``nproc`` ranks running ``target`` (``["-m", module,
    *args]`` or ``[script, *args]``), in a session of its own; its output goes to
    ``<workdir>/log-<label>.txt``, each rank's also to files under :func:`rank_log_dir`, and its
    rank 0 events (if any) are read from ``<workdir>/events-<label>.jsonl``."""
    log = open(workdir / f"log-{label}.txt", "ab")  # noqa: SIM115 - owned by the child
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        # Each rank's stdout and stderr in files of its own, and still in torchrun's log (tee):
        # torchrun's summary of a rank killed by a signal is its exit code only (the cause of one
        # SIGSEGV of rank 1 after the last save was lost so), and its default log directory is a
        # temporary one that nothing names.
        "--log-dir",
        str(rank_log_dir(workdir, label)),
        "--tee",
        "3",
        *target,
    ]
    # faulthandler: a rank killed by SIGSEGV, SIGBUS, SIGFPE, SIGABRT or SIGILL prints every
    # thread's Python stack to its stderr first.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Job(label, proc, workdir / f"events-{label}.jsonl")


def launch(
    label: str,
    workdir: Path,
    data: Path,
    args: argparse.Namespace,
    volume: str | None,
    final: Path,
    *,
    nproc: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
) -> Job:
    target = [
        "-m",
        "uc_checkpoint.demo.train",
        "--data",
        str(data),
        "--events",
        str(workdir / f"events-{label}.jsonl"),
        "--final",
        str(final),
        "--steps",
        str(steps or args.steps),
        "--save-every",
        str(args.save_every),
        "--model",
        args.model,
        "--batch-size",
        str(batch_size or args.batch_size),
        "--async-mode",
        args.async_mode,
        "--staging-dir",
        str(workdir / "staging"),
        "--data-workers",
        str(args.data_workers),
        "--samples-log",
        str(workdir / f"samples-{label}"),
        "--final-data",
        str(workdir / f"data-state-{label}.json"),
    ]
    if volume is not None:
        target += ["--volume", volume]
    return start_torchrun(label, workdir, nproc or args.nproc, target)


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


def kill_process_tree(root: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` (default SIGKILL) to ``root`` and all its descendants at once, as a scheduler
    stopping every process of a node does. Returns the pids signalled (those already gone are
    skipped)."""
    signalled = []
    for pid in _process_tree(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        signalled.append(pid)
    return signalled


def kill_job(job: Job) -> None:
    """SIGKILL torchrun and every rank at once, as a preemption would."""
    kill_process_tree(job.proc.pid)
    job.proc.wait()


def follow(job: Job, deadline: float, kill_at: int | None = None) -> str:
    """Print the job's progress until it exits; with ``kill_at``, SIGKILL it as soon as that step's
    checkpoint upload has started. Returns ``"done"``, ``"killed"`` or ``"failed"``."""
    while True:
        for ev in job.poll_events():
            kind = ev["event"]
            if kind == "start":
                say(
                    f"  [{job.label}] {ev['world_size']} rank{'' if ev['world_size'] == 1 else 's'}, {ev['params']:,} parameters, starting at step {ev['step']}"
                )
            elif kind == "resume":
                say(
                    f"  [{job.label}] resumed from {ev['location']} at step {ev['step']} in {ev['load_s']:.2f} s "
                    f"(saved by {ev['saved_world_size']} ranks, now {ev['world_size']})"
                )
                for line in describe_data_resume(ev["data"]):
                    say(f"  [{job.label}]   {line}")
            elif kind == "epoch":
                say(f"  [{job.label}] data: all ranks start epoch {ev['epoch']} at step {ev['step']}")
            elif kind == "step" and (ev["step"] % 5 == 0 or ev["step"] == 1):
                say(f"  [{job.label}] step {ev['step']:4d}  loss {ev['loss']:.4f}")
            elif kind == "save_start":
                say(
                    f"  [{job.label}] checkpoint step {ev['step']}: async_save returned after {ev['blocked_s']:.3f} s, uploading"
                )
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


def describe_data_resume(d: dict[str, Any]) -> list[str]:
    """The tracker's resume summary as printable lines: what is skipped, where each worker seeks."""
    names = ", ".join(d["skipped_names"]) + (" ..." if d["skipped_shards"] > len(d["skipped_names"]) else "")
    lines = [
        f"data: epoch {d['epoch']}, {d['samples_consumed_in_epoch']} samples consumed, "
        f"{d['samples_remaining']} remaining; {d['skipped_shards']} shards skipped outright"
        + (f" ({names})" if names else "")
    ]
    seeks = [f"rank {r} worker {w} -> {name} sample {o}" for r, w, name, o in d["seeks"]]
    for i in range(0, len(seeks), 2):
        lines.append(("seek: " if i == 0 else "      ") + "; ".join(seeks[i : i + 2]))
    return lines


def read_samples(workdir: Path, label: str) -> dict[int, list[tuple[int, int]]]:
    """Samples trained on per step (all ranks, rank order) from a job's per-rank logs."""
    per_step: dict[int, list[tuple[int, int]]] = {}
    for path in sorted(workdir.glob(f"samples-{label}-rank*.jsonl"), key=lambda p: int(p.stem.rsplit("rank", 1)[1])):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                per_step.setdefault(rec["step"], []).extend((a, b) for a, b in rec["samples"])
    return per_step


def check_exactly_once(
    workdir: Path, chain: list[Job], reference: Job, shards: Any, seq_len: int
) -> tuple[list[str], list[str]]:
    """Check the data stream of the interrupted-and-resumed chain of jobs against one epoch.

    Every job counts up to the step its successor resumed from (what came after was lost with the
    kill and trained again). Together with the remaining work in the last job's final data state,
    every sample of the epoch must appear exactly once. Steps the 2-rank runs share with the
    reference run must have read the same samples. Returns (report lines, problems).
    """
    from collections import Counter

    consumed: list[tuple[int, int]] = []
    problems: list[str] = []
    ref = read_samples(workdir, reference.label)
    for i, job in enumerate(chain):
        upto = None
        if i + 1 < len(chain):
            upto = next((e["step"] for e in chain[i + 1].events if e["event"] == "resume"), None)
        for step, samples in sorted(read_samples(workdir, job.label).items()):
            if upto is not None and step > upto:
                continue
            consumed += samples
            if step in ref and len(samples) == len(ref[step]) and samples != ref[step]:
                problems.append(f"{job.label} step {step} read other samples than the reference run")
    state = json.loads((workdir / f"data-state-{chain[-1].label}.json").read_text(encoding="utf-8"))
    remaining = [(sh, j) for sh, a, b in state["remaining"] for j in range(a, b)]
    counts = Counter(consumed)
    repeated = [p for p, n in counts.items() if n > 1]
    overlap = set(counts) & set(remaining)
    total = sum(shards.samples_per_shard(seq_len))
    if state["epoch"] != 0:
        problems.append(f"the runs crossed into epoch {state['epoch']}: the demo checks one epoch only")
    if repeated:
        problems.append(f"{len(repeated)} samples trained on twice, e.g. (shard, sample) {repeated[:3]}")
    if overlap:
        problems.append(f"{len(overlap)} samples trained on are still listed as remaining")
    if len(counts) + len(remaining) != total:
        problems.append(f"{total - len(counts) - len(remaining)} samples of the epoch were lost")
    sizes = [next((e["world_size"] for e in j.events if e["event"] == "start"), 0) for j in chain]
    hops = " -> ".join(f"{n} rank{'' if n == 1 else 's'}" for n in sizes)
    lines = [
        f"data: {len(chain)} runs ({hops}) trained on {len(consumed)} samples of epoch 0, "
        f"{len(counts)} distinct; {len(remaining)} remain in the last checkpoint; epoch size {total}"
    ]
    return lines, problems


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
    from uc_checkpoint.demo.data import build_shards

    if args.save_every < 1 or args.steps < 3 * args.save_every:
        raise SystemExit("uc-checkpoint demo: --steps must be at least 3 x --save-every")
    kill_at = args.kill_at if args.kill_at is not None else 3 * args.save_every
    if kill_at % args.save_every or not args.save_every <= kill_at < args.steps:
        raise SystemExit(f"uc-checkpoint demo: --kill-at {kill_at} must be a checkpoint step before --steps")
    workers = max(1, args.data_workers)
    if args.data_workers < 0 or args.save_every % workers:
        # DataLoader workers hand out batches in turn; a resume is read-for-read identical to the
        # uninterrupted run only when every worker has delivered the same number of batches.
        raise SystemExit("uc-checkpoint demo: --save-every must be a multiple of --data-workers")
    if args.resize_to < 0 or (args.resize_to and (args.batch_size * args.nproc) % args.resize_to):
        raise SystemExit(
            "uc-checkpoint demo: --resize-to must divide --nproc x --batch-size (the global batch is kept)"
        )
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="uc-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    volume = args.volume or str(workdir / "volume")
    vol = open_volume(volume)
    if vol.list_files():
        raise SystemExit(f"uc-checkpoint demo: the volume {volume} is not empty; give a new location")
    deadline_each = args.timeout
    started = time.time()

    from uc_checkpoint.demo.model import GPTConfig

    seq_len = (GPTConfig.demo() if args.model == "demo" else GPTConfig.gpt2_small()).seq_len
    resize_steps = args.save_every if args.resize_to else 0
    # An epoch a little longer than the whole demo reads, cut into many small shards, so that resumes
    # skip whole shards and seek inside others (a real corpus is much bigger; the mechanics are the same).
    planned = args.nproc * args.batch_size * (args.steps + resize_steps)
    shards = build_shards(
        workdir / "data", num_shards=DEMO_SHARDS, max_bytes=(planned * 5 // 4 + 4 * DEMO_SHARDS) * (seq_len + 1)
    )
    resize = f", then resumed on {args.resize_to} rank(s) for {resize_steps} steps" if args.resize_to else ""
    say(
        f"uc_checkpoint demo: {args.nproc} ranks x {args.data_workers} DataLoader workers, {args.steps} steps, "
        f"checkpoint every {args.save_every}, preemption at step {kill_at}{resize}"
    )
    say(f"  workdir {workdir}\n  volume  {volume}")
    say(f"  logs    {workdir}/log-<run>.txt, each rank's under {workdir}/ranks-<run>/")
    say(
        f"  data: {len(shards.shards)} shards, {shards.num_samples(seq_len):,} samples ({shards.total_bytes:,} bytes of "
        "Python standard library source) per epoch"
    )

    say("1/4 reference run, uninterrupted, no checkpoints")
    ref_final = workdir / "final-reference.pt"
    reference = job = launch("reference", workdir, shards.root, args, None, ref_final)
    if follow(job, time.time() + deadline_each) != "done":
        say(f"FAIL: the reference run failed; see {job_logs(workdir, 'reference')}")
        return 1

    say("2/4 run with checkpoints, preempted while a checkpoint uploads")
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
            published = {info.step: info.published for info in catalog.list_steps(vol)}
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
            say("3/4 restart: resume from the newest published checkpoint")
            continue
        break
    if outcome != "done":
        say(f"FAIL: the training job failed; see {job_logs(workdir, job.label)}")
        return 1

    problems = compare(ref_final, final)
    if problems:
        problems = [f"final parameters differ from the uninterrupted run: {problems[:5]}"]
    elif not killed_in_flight or not resumes:
        problems = ["no preemption during an upload was exercised"]
    else:
        say("  final parameters are bit-identical to the uninterrupted run")

    if args.resize_to and not problems:
        say(
            f"4/4 resume the finished run on {args.resize_to} rank{'' if args.resize_to == 1 else 's'} (same global "
            f"batch) for {resize_steps} more steps"
        )
        job = launch(
            "resized",
            workdir,
            shards.root,
            args,
            volume,
            workdir / "final-resized.pt",
            nproc=args.resize_to,
            batch_size=args.batch_size * args.nproc // args.resize_to,
            steps=args.steps + resize_steps,
        )
        jobs.append(job)
        if follow(job, time.time() + deadline_each) != "done":
            say(f"FAIL: the resized run failed; see {job_logs(workdir, job.label)}")
            return 1
        resumes += [e for e in job.events if e["event"] == "resume"]
    if not problems:
        lines, problems = check_exactly_once(workdir, jobs, reference, shards, seq_len)
        for line in lines:
            say(f"  {line}")
    print_table(jobs, vol, resumes, unpublished)
    elapsed = time.time() - started
    if problems:
        say(f"FAIL: {'; '.join(problems)} ({elapsed:.0f} s, workdir {workdir})")
        return 1
    say(
        f"PASS: final parameters bit-identical to the uninterrupted run; every sample trained on exactly once "
        f"across the preemption{' and the resize' if args.resize_to else ''} ({elapsed:.0f} s, workdir {workdir})"
    )
    if not args.workdir:
        shutil.rmtree(workdir / "staging", ignore_errors=True)
    return 0


def print_table(jobs: list[Job], vol: Any, resumes: list[dict[str, Any]], unpublished: set[tuple[str, int]]) -> None:
    from uc_checkpoint.dcp.metadata_io import read_metadata  # torch: not for `uc-checkpoint --help`

    sizes = {}
    for info in catalog.list_steps(vol):
        location = vol.child(info.name)
        # A published checkpoint's size is what its .metadata references: files of a killed save
        # at the same step stay beside them until `uc-checkpoint gc`, and are not part of it.
        entries = entries_of(getattr(read_metadata(location), MANIFEST_ATTR, None)) if info.published else {}
        sizes[info.step] = sum(e.size for e in entries.values()) or sum(
            s for s in location.list_files().values() if s > 0
        )
    say("")
    say(f"{'run':8} {'step':>5} {'size MB':>8} {'blocked s':>10} {'to .metadata s':>15} {'MB/s':>7}  state")
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
            say(f"{job.label:8} {step:5d} {size / 1e6:8.2f} {ev['blocked_s']:10.3f} {publish:>15} {rate:>7}  {state}")
    for ev in resumes:
        d = ev["data"]
        say(
            f"resume: step {ev['step']} from {ev['location']} ({ev['saved_world_size']} -> {ev['world_size']} ranks; "
            f"epoch {d['epoch']}, {d['samples_consumed_in_epoch']} samples consumed, {d['skipped_shards']} shards "
            f"skipped, {len(d['seeks'])} seeks), load {ev['load_s']:.2f} s"
        )
    say("")


if __name__ == "__main__":
    raise SystemExit(main())
