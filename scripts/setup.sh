#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: uc-checkpoint in editable mode
# with its test extra (UC_SETUP_EXTRAS=test,bench adds the benchmark extra). torch is pinned to the
# 2.13.0 CPU wheel by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
log=$(mktemp)
echo "set-up: installing uc-checkpoint and its dependencies into .venv (torch 2.13.0 CPU; a few minutes on a fresh machine; log: $log)" >&2
if ! .venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt -e ".[${UC_SETUP_EXTRAS:-test}]" >"$log" 2>&1; then
    grep -vE "Location .* is ignored" "$log" >&2
    echo "set-up failed: pip install did not succeed (full log above)" >&2
    exit 1
fi
rm -f "$log"
.venv/bin/python -c "import torch, numpy, uc_checkpoint; print(f'set-up ok: torch {torch.__version__}, uc_checkpoint {uc_checkpoint.__version__}')"
