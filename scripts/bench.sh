#!/usr/bin/env bash
# Set up (with the benchmark extras), then run the checkpoint benchmark and write docs/benchmarks.md.
# Needs root (FUSE mounts; s3fs and bindfs are apt-installed when missing). Arguments go to
# `python -m benchmarks.run` (--size-mb, --kinds KIND[:MIB] ..., --ranks, --repeats, --cases).
set -euo pipefail
cd "$(dirname "$0")/.."
UC_SETUP_EXTRAS=test,bench ./scripts/setup.sh
exec .venv/bin/python -m benchmarks.run "$@"
