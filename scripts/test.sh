#!/usr/bin/env bash
# Set up when needed (scripts/setup.sh --if-needed), then run the test suite: pyproject.toml's
# testpaths, tests/. Extra arguments go to pytest; `UC_SETUP_EXTRAS=test,bench ./scripts/test.sh
# benchmarks` runs the benchmarks' quick tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --if-needed
# Two workers (most tests wait on a server or a process, not the CPU); the slowest tests are not
# left for the end (worksteal). `-n 0` after it runs in this process (needed for `-s` output).
exec .venv/bin/python -m pytest -n "${UC_TEST_WORKERS:-2}" --dist worksteal "$@"
