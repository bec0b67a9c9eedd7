"""The ``uc-checkpoint`` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``uc-checkpoint``; returns the process exit code."""
    from .demo import run as demo_run

    parser = argparse.ArgumentParser(prog="uc-checkpoint", description="Staged, crash-safe DCP checkpoints on volumes")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="resume-after-preemption demo: train, get killed mid-upload, resume, compare")
    demo_run.build_parser(demo)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo_run.run_demo(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
