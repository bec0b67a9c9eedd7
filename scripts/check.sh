#!/usr/bin/env bash
# Lint, format and type checks, with the versions constraints.txt pins: ruff check (pyproject.toml's
# [tool.ruff]), ruff format --check, and mypy over the package ([tool.mypy]). Sets up first when
# needed (scripts/setup.sh --if-needed). Runs all three and exits 1 if any failed;
# `.venv/bin/ruff format .` fixes what the format check finds.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --if-needed || exit 1
sources=(uc_checkpoint tests benchmarks scripts)
failed=()
.venv/bin/ruff check --no-cache "${sources[@]}" || failed+=("ruff check")
.venv/bin/ruff format --check --no-cache "${sources[@]}" || failed+=("ruff format --check")
.venv/bin/mypy || failed+=(mypy)
if ((${#failed[@]})); then
    echo "check failed: ${failed[*]}" >&2
    exit 1
fi
echo "check ok: ruff check, ruff format --check, mypy"
