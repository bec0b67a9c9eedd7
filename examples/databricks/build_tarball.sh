#!/usr/bin/env bash
# Build the AI Runtime code archive: src/ and examples/train_fsdp.py under one top-level directory
# (the runtime unpacks it on every node to /databricks/code_source/<that directory> and sets
# CODE_SOURCE_PATH to it). The bundle runs this as its artifact build and uploads the archive.
#
#   bash build_tarball.sh [OUT_DIR]     # default: dist/ next to this script; writes OUT_DIR/code.tgz
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$(mkdir -p "${1:-$here/dist}" && cd "${1:-$here/dist}" && pwd)"
top=uc_checkpoint_example
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT

mkdir "$build/$top"
cp -R "$here/src/." "$build/$top/"
cp "$here/../train_fsdp.py" "$build/$top/train_fsdp.py"
tar -czf "$out/code.tgz" -C "$build" "$top"
echo "built $out/code.tgz:"
tar -tzf "$out/code.tgz"
