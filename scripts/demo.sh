#!/usr/bin/env bash
# Set up when needed (scripts/setup.sh --if-needed), then run the resume-after-preemption demo on its
# default local volume.
# Extra arguments go to `uc-checkpoint demo` (see `uc-checkpoint demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --if-needed
exec .venv/bin/uc-checkpoint demo "$@"
