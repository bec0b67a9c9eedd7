"""The ``uc-checkpoint`` command line: ``ls``, ``inspect``, ``verify``, ``gc``, ``export``, ``demo``, ``bench``.

Every verb takes local/FUSE paths, ``s3://bucket/prefix`` (boto3's configuration from the environment,
e.g. ``AWS_ENDPOINT_URL``) and fsspec URLs. ``--json`` prints one JSON document for scripts. A user
mistake or a checkpoint problem is one line on stderr and a non-zero exit (2 for errors, 1 for a
checkpoint that fails ``verify``), never a traceback.

Start-up imports no torch: a verb imports what it needs when it runs, and only what decodes a
``.metadata`` in full (``inspect``, ``verify``, ``gc``) or saves (``demo``) pulls torch in. ``ls``
never does: it reads what each ``.metadata`` references without torch
(:func:`uc_checkpoint.format.metadata_peek.peek_metadata`).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def _size(n: int | None) -> str:
    if n is None or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _count(n: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``: ``n`` and ``noun``, plural unless ``n`` is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= span:
            return f"{s / span:.1f}{unit}"
    return f"{s:.0f}s"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def _volume_options(pairs: list[str] | None) -> dict[str, Any]:
    """``-o KEY=VALUE`` options: a Python literal (``8``, ``False``, ``None``, ``'x'``) or else the
    text itself."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise _UserError(f"-o takes KEY=VALUE, got {pair!r}")
        words = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False, "none": None}
        if text.strip().lower() in words:
            out[key.strip()] = words[text.strip().lower()]
            continue
        try:
            out[key.strip()] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key.strip()] = text
    return out


def _where(args: argparse.Namespace, location: str) -> Any:
    """The location as given, or its volume built with the ``-o`` options."""
    options = _volume_options(getattr(args, "volume_option", None))
    if not options:
        return location
    from uc_checkpoint.volumes import open_volume

    return open_volume(location, **options)


def _ls(args: argparse.Namespace) -> int:
    from uc_checkpoint.ops.summary import list_root, summary_dict

    rows = list_root(_where(args, args.root), check=args.check)
    if args.json:
        _print_json([summary_dict(r) for r in rows])
        return 0
    if not rows:
        from uc_checkpoint.volumes import open_volume

        hint = ""
        if ".metadata" in open_volume(_where(args, args.root)).list_files():
            hint = f" ({args.root} is itself one checkpoint: try `uc-checkpoint inspect {args.root}`)"
        print(f"no step_* checkpoints under {args.root}{hint}")
        return 0
    print(f"{'step':>10}  {'state':10}  {'size':>10}  {'files':>5}  {'age':>6}  location")
    for r in rows:
        print(f"{r.step:>10}  {r.state:10}  {_size(r.bytes):>10}  {r.files:>5}  {_age(r.age_s):>6}  {r.location}")
        if r.problem:
            print(f"{'':>10}  problem: {r.problem}")
        if r.unreferenced_files:
            n = r.unreferenced_files
            print(
                f"{'':>10}  also {n} unreferenced file{'' if n == 1 else 's'}, {_size(r.unreferenced_bytes)} "
                "(another save's, not part of this checkpoint): `uc-checkpoint gc` removes them once old"
            )
    unchecked = sum(r.state == "published" for r in rows)
    if unchecked:
        print(
            f"{unchecked} checkpoint{'' if unchecked == 1 else 's'} 'published': .metadata there, not checked "
            "(sizes count every file a save writes there); `--check all` checks them"
        )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from uc_checkpoint.ops.summary import describe_checkpoint

    info = describe_checkpoint(_where(args, args.checkpoint), data_state=not args.no_data_state)
    if args.json:
        _print_json(info)
        return 0
    print(f"checkpoint {info['location']}")
    if info.get("saved_by"):
        by = info["saved_by"]
        print(f"  saved by host {by.get('host')}, pid {by.get('pid')} (save {info.get('save_id')})")
    print(
        f"  {len(info['items'])} items, {_size(info['total_bytes'])} in {sum(len(v) for v in info['files'].values())} files"
    )
    print(f"\n  {'key':50} {'dtype':10} {'shape':24} {'size':>10} chunks")
    for item in info["items"]:
        shape = "x".join(map(str, item["shape"])) if item["shape"] is not None else "(object)"
        print(
            f"  {item['key'][:50]:50} {item['dtype'] or '-':10} {shape[:24]:24} {_size(item['bytes']):>10} {item['chunks']}"
        )
    print("\n  data files by rank:")
    for rank, files in sorted(
        info["files"].items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)
    ):
        print(f"    rank {rank}: {len(files)} files, {_size(sum(f['bytes'] for f in files if f['bytes'] > 0))}")
    for key, st in (info.get("data_pipeline") or {}).items():
        if "error" in st:
            print(f"\n  data pipeline ({key}): unreadable: {st['error']}")
            continue
        print(
            f"\n  data pipeline ({key}): epoch {st['epoch']}, {st['samples_consumed_in_epoch']} samples consumed, "
            f"{st['samples_remaining_in_epoch']} remaining in {st['shards_with_remaining_work']} of {st['num_shards']} "
            f"shards (seed {st['seed']}{', shuffled within shards' if st.get('shuffle_within_shard') else ''})"
        )
        eo = st.get("exactly_once") or {}
        if eo.get("checks_out") is None:
            print(f"    exactly-once digest: not checkable: {eo.get('problem')}")
        else:
            verdict = "checks out so far" if eo["checks_out"] else f"DOES NOT check out: {eo['problem']}"
            print(
                f"    exactly-once digest: {eo['samples_covered']} samples covered, {eo['shards_complete']} of "
                f"{eo['shards']} shards complete; {verdict}"
            )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from uc_checkpoint.ops.verify import verify_checkpoint

    bar = None
    if not args.json and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr)
    try:
        report = verify_checkpoint(_where(args, args.checkpoint), progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        _print_json(
            {
                "location": report.location,
                "ok": report.ok,
                "files_checked": report.files_checked,
                "files_checksummed": report.files_checksummed,
                "bytes_checked": report.bytes_checked,
                "checksums": report.checksums,
                "problems": report.problems,
            }
        )
    else:
        for problem in report.problems:
            print(f"problem: {problem}", file=sys.stderr)
        n = len(report.problems)
        verdict = "OK" if report.ok else f"FAILED ({n} problem{'' if n == 1 else 's'})"
        what = (
            f"{report.files_checksummed} checksummed ({_size(report.bytes_checked)} read)"
            if report.checksums
            else "sizes only: no manifest, so no checksums"
        )
        print(f"{report.location}: {verdict}; {report.files_checked} data files checked, {what}")
    return 0 if report.ok else 1


def _gc(args: argparse.Namespace) -> int:
    from uc_checkpoint.ops.garbage import DEFAULT_GRACE_S, collect_garbage

    report = collect_garbage(
        _where(args, args.root),
        grace_s=DEFAULT_GRACE_S if args.grace_s is None else args.grace_s,
        staging_dir=args.staging_dir,
        include_staging=not args.no_staging,
        dry_run=args.dry_run,
    )
    if args.json:
        _print_json(vars(report))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for path in report.deleted_files:
        print(f"{verb} {path}")
    for path in report.removed_staging_dirs:
        print(f"{verb} staging dir {path}")
    for url in report.spared_locations:
        print(f"spared {url} (recent files or unreadable .metadata)")
    # A dry run lists no multipart uploads (they are found and aborted in one call), so it says so.
    uploads = (
        "incomplete multipart uploads are left for a run without --dry-run"
        if args.dry_run
        else f"aborted {report.aborted_uploads} multipart uploads"
    )
    print(
        f"{verb} {len(report.deleted_files)} files ({report.deleted_bytes} bytes), "
        f"{len(report.removed_staging_dirs)} staging dirs; {uploads}"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from uc_checkpoint.ops.export import export_checkpoint, parse_size

    bar = None
    if not args.json and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="export", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    try:
        summary = export_checkpoint(
            args.checkpoint,
            _where(args, args.dest),
            format=args.format,
            key=args.key,
            strip_prefix=args.strip_prefix,
            dtype=args.dtype,
            max_shard_bytes=parse_size(args.max_shard_size),
            overwrite=args.overwrite,
            staging_dir=args.staging_dir,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        _print_json(summary.as_dict())
        return 0
    print(
        f"exported {_count(summary.tensors, 'tensor')} ({_size(summary.tensor_bytes)}) to {summary.destination} "
        f"in {_count(len(summary.files), 'file')}: {summary.entry} ({summary.seconds:.1f} s)"
    )
    if summary.skipped:
        shown = ", ".join(summary.skipped[:5]) + (" ..." if len(summary.skipped) > 5 else "")
        n = len(summary.skipped)
        print(f"not exported ({_count(n, 'item')} that {'is not a tensor' if n == 1 else 'are not tensors'}): {shown}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    repo = Path(__file__).resolve().parent.parent
    if not (repo / "benchmarks" / "run.py").is_file():
        raise _UserError(
            "uc-checkpoint bench needs a source checkout (benchmarks/ beside the package); run ./scripts/bench.sh there"
        )
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.call([sys.executable, "-m", "benchmarks.run", *args.bench_args], cwd=repo, env=env)


class _UserError(Exception):
    """A mistake on the command line, reported as one line."""


def build_parser() -> argparse.ArgumentParser:
    from uc_checkpoint.demo import run as demo_run

    parser = argparse.ArgumentParser(prog="uc-checkpoint", description="Staged, crash-safe DCP checkpoints on volumes")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO) to stderr")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress (INFO) to stderr"
    )
    common.add_argument(
        "-o",
        "--volume-option",
        action="append",
        metavar="KEY=VALUE",
        help="volume option, repeatable: S3Volume's (endpoint_url=..., addressing_style=path, "
        "checksums=False, ...) or an fsspec filesystem's storage options",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    ls = sub.add_parser("ls", parents=[common], help="the checkpoints under a root: step, state, size, files, age")
    ls.add_argument("root", help="checkpoint root: path, s3://bucket/prefix or fsspec URL")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument(
        "--check",
        choices=("none", "latest", "all"),
        default="latest",
        help="which published checkpoints to check against their .metadata (one read each): the newest until "
        "one is complete, what a resume loads (latest, the default), every one (all), or none; the others "
        "show as 'published'",
    )

    ins = sub.add_parser(
        "inspect",
        parents=[common],
        help="one checkpoint's keys (dtype, shape, size), files per rank, data-pipeline state",
    )
    ins.add_argument("checkpoint", help="checkpoint location: path or URL")
    ins.add_argument("--json", action="store_true", help="print JSON")
    ins.add_argument("--no-data-state", action="store_true", help="do not read the data-pipeline state item")

    ver = sub.add_parser(
        "verify", parents=[common], help="check every file of a checkpoint against its manifest (exit 1 on a problem)"
    )
    ver.add_argument("checkpoint", help="checkpoint location: path or URL")
    ver.add_argument("--json", action="store_true", help="print JSON")

    gc = sub.add_parser(
        "gc", parents=[common], help="delete what failed saves left under a checkpoint root (older than a grace period)"
    )
    gc.add_argument("root", help="checkpoint root (or one checkpoint location): path, s3://bucket/prefix or fsspec URL")
    gc.add_argument(
        "--grace-s",
        type=float,
        default=None,
        help="spare anything younger than this many seconds (default 21600 = 6 h)",
    )
    gc.add_argument("--dry-run", action="store_true", help="only report what would be deleted")
    gc.add_argument(
        "--staging-dir", help="staging root to clean too (default: $UC_CHECKPOINT_STAGING_DIR or the temp dir)"
    )
    gc.add_argument("--no-staging", action="store_true", help="leave local staging directories alone")
    gc.add_argument("--json", action="store_true", help="print JSON")

    exp = sub.add_parser(
        "export",
        parents=[common],
        help="write a checkpoint's full tensors as safetensors or torch.save files for serving (docs/export.md)",
    )
    exp.add_argument("checkpoint", help="checkpoint location: path or URL")
    exp.add_argument("dest", help="export location: path or URL (-o options apply to it)")
    exp.add_argument("--format", required=True, choices=("safetensors", "torch"), help="output format")
    exp.add_argument("--key", help="export only this sub-dict (e.g. model), its entries named as in it")
    exp.add_argument("--strip-prefix", metavar="PREFIX", help="remove PREFIX (e.g. _orig_mod. or module.) from names")
    exp.add_argument("--dtype", help="convert floating-point tensors to this dtype (bfloat16, float16, float32, ...)")
    exp.add_argument(
        "--max-shard-size", default="5GB", help="largest output file before a new one starts (default 5GB; 2GiB, ...)"
    )
    exp.add_argument("--overwrite", action="store_true", help="replace an export of this format at dest")
    exp.add_argument("--staging-dir", help="local dir for files being written (default: $UC_CHECKPOINT_STAGING_DIR)")
    exp.add_argument("--json", action="store_true", help="print a JSON summary")

    demo = sub.add_parser("demo", help="resume-after-preemption demo: train, get killed mid-upload, resume, compare")
    demo_run.build_parser(demo)

    bench = sub.add_parser("bench", help="the checkpoint benchmark and its report (source checkout, root)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for python -m benchmarks.run")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``uc-checkpoint``; returns the process exit code."""
    from uc_checkpoint.errors import UCCheckpointError, rank_error

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = [*extra, *args.bench_args]  # every option belongs to benchmarks.run
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    handlers = {"ls": _ls, "inspect": _inspect, "verify": _verify, "gc": _gc, "export": _export, "bench": _bench}
    try:
        if args.command == "demo":
            from uc_checkpoint.demo import run as demo_run

            return demo_run.run_demo(args)
        return handlers[args.command](args)
    except BrokenPipeError:
        # The reader of our output went away (e.g. `| head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UCCheckpointError, _UserError, ValueError, OSError) as exc:
        print(f"uc-checkpoint {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:  # DCP's CheckpointException is a BaseException carrying our errors
        if not _is_dcp_failure(exc):
            raise
        print(f"uc-checkpoint {args.command}: error: {rank_error(exc)}", file=sys.stderr)
        return 2


def _is_dcp_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is DCP's ``CheckpointException``. DCP is imported only if something already
    did (a verb that loaded a checkpoint): the CLI starts without torch, and an exception cannot
    come from a module nobody imported (a Ctrl-C must not wait for torch to import)."""
    if "torch.distributed.checkpoint" not in sys.modules:
        return False
    from torch.distributed.checkpoint import CheckpointException

    return isinstance(exc, CheckpointException)


if __name__ == "__main__":
    raise SystemExit(main())
