#!/usr/bin/env bash
# Build the AI Runtime code archive, dist/code.tgz: under one top-level directory (the runtime
# unpacks it on every node to /databricks/code_source/<that directory> and sets CODE_SOURCE_PATH to
# it) go src/ (command.sh, install_plugin.sh and their sidecars), ../train_fsdp.py and, in wheels/,
# the uc_checkpoint wheel built from this checkout: the nodes install that wheel, never a package
# index's "uc-checkpoint". The bundle runs this as its artifact's build (databricks.yml).
#
#   bash build_tarball.sh [OUT_DIR]     # default: dist/ next to this script; writes OUT_DIR/code.tgz
#
# The wheel is built with `pip wheel --no-deps --no-build-isolation` from a copy of the package's
# sources (the checkout is left as it was) by $PYTHON, else the checkout's .venv/bin/python (made by
# scripts/setup.sh), else python3; that Python needs pip, setuptools>=68 and wheel.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$(mkdir -p "${1:-$here/dist}" && cd "${1:-$here/dist}" && pwd)"
python="${PYTHON:-}"
[ -n "$python" ] || { [ -x "$repo/.venv/bin/python" ] && python="$repo/.venv/bin/python"; } || python=python3
if ! "$python" -c 'import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 68)' 2>/dev/null; then
    echo "build_tarball.sh: $python cannot build the uc_checkpoint wheel: it needs setuptools>=68 and wheel" \
        "(pip install 'setuptools>=68' wheel), or set PYTHON to a Python that has them" >&2
    exit 2
fi
top=uc_checkpoint_example
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT

mkdir -p "$build/$top/wheels" "$build/package"
cp -R "$here/src/." "$build/$top/"
cp "$repo/examples/train_fsdp.py" "$build/$top/train_fsdp.py"
tar -cf - -C "$repo" --exclude=__pycache__ pyproject.toml README.md uc_checkpoint | tar -xf - -C "$build/package"
"$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$build/$top/wheels" "$build/package"
tar -czf "$out/code.tgz" -C "$build" "$top"
echo "built $out/code.tgz:"
tar -tzf "$out/code.tgz"
