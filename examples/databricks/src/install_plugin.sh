#!/usr/bin/env bash
# Install the uc_checkpoint wheel that the code archive ships (wheels/ next to this script, built by
# build_tarball.sh) into the job's Python, keeping the runtime's torch: pip gets a constraint that
# pins torch to the version already installed, so it can never replace the runtime's CUDA build.
# If that torch is outside the range the wheel accepts, pip stops with a resolution error naming
# torch, before any training starts. Other missing dependencies (fsspec, boto3, ...) are installed.
#
#   bash install_plugin.sh [PIP_OPTION...]     # e.g. --quiet; --dry-run --report FILE (what pip would do)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
shopt -s nullglob
wheels=("$here"/wheels/uc_checkpoint-*.whl)
if [ "${#wheels[@]}" -ne 1 ]; then
    echo "install_plugin.sh: expected one uc_checkpoint wheel in $here/wheels, found ${#wheels[@]} (build_tarball.sh puts it there)" >&2
    exit 2
fi
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
if ! python -c 'import torch; print(f"torch=={torch.__version__}")' > "$pins"; then
    echo "install_plugin.sh: the job's python cannot import torch; uc_checkpoint runs on the runtime's torch" >&2
    exit 2
fi
echo "installing ${wheels[0]##*/} with $(cat "$pins") kept"
python -m pip install --constraint "$pins" "$@" "${wheels[0]}"
