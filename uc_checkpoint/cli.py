"""The ``uc-checkpoint`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``uc-checkpoint``; returns the process exit code."""
    from .demo import run as demo_run

    parser = argparse.ArgumentParser(prog="uc-checkpoint", description="Staged, crash-safe DCP checkpoints on volumes")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="resume-after-preemption demo: train, get killed mid-upload, resume, compare")
    demo_run.build_parser(demo)
    gc = sub.add_parser("gc", help="delete what failed saves left under a checkpoint root (older than a grace period)")
    gc.add_argument("root", help="checkpoint root: path, s3://bucket/prefix or fsspec URL")
    gc.add_argument("--grace-s", type=float, default=None,
                    help="spare anything younger than this many seconds (default 21600 = 6 h)")
    gc.add_argument("--dry-run", action="store_true", help="only report what would be deleted")
    gc.add_argument("--staging-dir", help="staging root to clean too (default: $UC_CHECKPOINT_STAGING_DIR or the temp dir)")
    gc.add_argument("--no-staging", action="store_true", help="leave local staging directories alone")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo_run.run_demo(args)
    if args.command == "gc":
        return _gc(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _gc(args: argparse.Namespace) -> int:
    import logging

    from .garbage import DEFAULT_GRACE_S, collect_garbage

    from .errors import UCCheckpointError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = collect_garbage(
            args.root, grace_s=DEFAULT_GRACE_S if args.grace_s is None else args.grace_s,
            staging_dir=args.staging_dir, include_staging=not args.no_staging, dry_run=args.dry_run,
        )
    except (UCCheckpointError, ValueError) as exc:
        print(f"uc-checkpoint gc: error: {exc}", file=sys.stderr)
        return 2
    verb = "would delete" if args.dry_run else "deleted"
    for path in report.deleted_files:
        print(f"{verb} {path}")
    for path in report.removed_staging_dirs:
        print(f"{verb} staging dir {path}")
    for url in report.spared_locations:
        print(f"spared {url} (recent files or unreadable .metadata)")
    print(f"{verb} {len(report.deleted_files)} files ({report.deleted_bytes} bytes), "
          f"{len(report.removed_staging_dirs)} staging dirs; aborted {report.aborted_uploads} multipart uploads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
