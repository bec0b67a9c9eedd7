#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: uc-checkpoint in editable mode
# with its test extra (UC_SETUP_EXTRAS=test,bench adds the benchmark extra). torch is pinned to the
# 2.13.0 CPU wheel by constraints.txt.
#
#   ./scripts/setup.sh              install now, always
#   ./scripts/setup.sh --if-needed  install only when .venv is missing, pyproject.toml or
#                                   constraints.txt changed since the last install, or an extra
#                                   asked for was not installed (scripts/test.sh and check.sh)
#
# A successful install writes .venv/.uc-setup-stamp: the SHA-256 of pyproject.toml and
# constraints.txt, then the extras installed. The package is installed in editable mode, so a
# change to its code needs no new install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${UC_SETUP_EXTRAS:-test}
stamp=.venv/.uc-setup-stamp
inputs=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ "${1:-}" = "--if-needed" ] && [ -x .venv/bin/python ] && [ -f "$stamp" ]; then
    read -r stamped stamped_extras <"$stamp" || true
    if [ "$stamped" = "$inputs" ]; then
        missing=0
        for extra in ${extras//,/ }; do
            case ",${stamped_extras:-}," in *",$extra,"*) ;; *) missing=1 ;; esac
        done
        if [ "$missing" = 0 ]; then
            exit 0
        fi
    fi
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
rm -f "$stamp"
log=$(mktemp)
echo "set-up: installing uc-checkpoint and its dependencies into .venv (torch 2.13.0 CPU; a few minutes on a fresh machine; log: $log)" >&2
if ! .venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt -e ".[$extras]" >"$log" 2>&1; then
    grep -vE "Location .* is ignored" "$log" >&2
    echo "set-up failed: pip install did not succeed (full log above)" >&2
    exit 1
fi
rm -f "$log"
.venv/bin/python -c "import torch, numpy, uc_checkpoint; print(f'set-up ok: torch {torch.__version__}, uc_checkpoint {uc_checkpoint.__version__}')"
echo "$inputs $extras" >"$stamp"
