#!/usr/bin/env bash
# Set up, then run the resume-after-preemption demo on its default local volume.
# Extra arguments go to `uc-checkpoint demo` (see `uc-checkpoint demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/uc-checkpoint demo "$@"
