#!/usr/bin/env bash
# Set up (with the benchmark extras), then regenerate every benchmark report: the checkpoint benchmark
# (`python -m benchmarks.run`: docs/benchmarks.md) and the scale benchmark (`python -m benchmarks.scale`:
# docs/benchmarks-scale.md, docs/benchmarks/scale*.{json,png} and the Scale section of docs/benchmarks.md)
# where the client CPU goes (`python -m benchmarks.profile`: docs/benchmarks-profile.md) and staging
# for async_save against DCP's DefaultStager (`python -m benchmarks.staging`: docs/benchmarks-staging.md;
# --skip-profile skips both).
#
#   ./scripts/bench.sh [--skip-run] [--skip-scale] [--skip-profile] [RUN ARGS...] [--scale SCALE ARGS...]
#
# RUN ARGS go to benchmarks.run (--size-mb, --kinds KIND[:MIB] ..., --ranks, --repeats, --cases); the
# arguments after --scale go to benchmarks.scale (--quick, --only, --sizes-mb, ...). benchmarks.run needs
# root (FUSE mounts; s3fs and bindfs are apt-installed when missing); benchmarks.scale does not.
set -euo pipefail
cd "$(dirname "$0")/.."
run=1 scale=1 profile=1 run_args=() scale_args=()
while (($#)); do
    case "$1" in
        --skip-run) run=0 ;;
        --skip-scale) scale=0 ;;
        --skip-profile) profile=0 ;;
        --scale) shift; scale_args=("$@"); break ;;
        *) run_args+=("$1") ;;
    esac
    shift
done
UC_SETUP_EXTRAS=test,bench ./scripts/setup.sh --if-needed
if ((run)); then
    .venv/bin/python -m benchmarks.run ${run_args[@]+"${run_args[@]}"}
fi
if ((scale)); then
    .venv/bin/python -m benchmarks.scale ${scale_args[@]+"${scale_args[@]}"}
fi
if ((profile)); then
    .venv/bin/python -m benchmarks.profile
    .venv/bin/python -m benchmarks.staging --report docs/benchmarks-staging.md
fi
