#!/usr/bin/env bash
# Set up when needed (scripts/setup.sh --if-needed), then run the test suite: pyproject.toml's
# testpaths, tests/. Extra arguments go to pytest; `UC_SETUP_EXTRAS=test,bench ./scripts/test.sh
# benchmarks` runs the benchmarks' quick tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --if-needed
exec .venv/bin/python -m pytest "$@"
