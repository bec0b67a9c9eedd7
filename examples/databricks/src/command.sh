#!/usr/bin/env bash
# The AI Runtime task runs this on every node (deployments[].command_path). It installs the
# uc_checkpoint wheel the code archive ships (install_plugin.sh: the runtime's torch is kept), then
# starts one torchrun agent per node from the variables the runtime sets; torchrun starts one rank
# per GPU:
#   NODE_RANK                    this node, 0 .. nodes - 1                    (default 0)
#   NUM_NODES, else WORLD_SIZE   the number of nodes (the runtime's WORLD_SIZE counts nodes; default 1)
#   MASTER_ADDR, MASTER_PORT     node 0's address and port for the rendezvous (default 127.0.0.1:29500)
#   ranks per node               the first of: GPUS_PER_NODE (yours, in env_vars.json), LOCAL_WORLD_SIZE
#                                (a launcher's), the GPUs `nvidia-smi --list-gpus` lists, 1
#   CODE_SOURCE_PATH             where the code archive was unpacked (required)
#   UC_CHECKPOINT_ROOT           checkpoint root, /Volumes/<catalog>/<schema>/<volume>/<run> (required)
#   TRAIN_ARGS                   more arguments for train_fsdp.py (optional), split as a POSIX shell
#                                splits words (Python's shlex): quotes group, backslashes escape,
#                                nothing is expanded or run
# Node-local staging: $UC_CHECKPOINT_STAGING_DIR if set, else the system temp dir.
set -euo pipefail

cd "${CODE_SOURCE_PATH:?CODE_SOURCE_PATH is not set: it names the unpacked code directory}"
root="${UC_CHECKPOINT_ROOT:?UC_CHECKPOINT_ROOT is not set: give the checkpoint root, /Volumes/<catalog>/<schema>/<volume>/<run>}"
nodes="${NUM_NODES:-${WORLD_SIZE:-1}}" nodes_from="$([ -n "${NUM_NODES:-}" ] && echo NUM_NODES || echo WORLD_SIZE)"

if [ -n "${GPUS_PER_NODE:-}" ]; then
    gpus="$GPUS_PER_NODE" from=GPUS_PER_NODE
elif [ -n "${LOCAL_WORLD_SIZE:-}" ]; then
    gpus="$LOCAL_WORLD_SIZE" from=LOCAL_WORLD_SIZE
else
    gpus="$( (nvidia-smi --list-gpus 2>/dev/null || true) | grep -c '^GPU' || true)" from="nvidia-smi --list-gpus"
    [ "$gpus" -ge 1 ] || gpus=1 from="no GPU found"
fi
positive() {  # positive NAME VALUE: exit 2 naming NAME unless VALUE is a positive integer
    if ! [[ "$2" =~ ^[1-9][0-9]*$ ]]; then
        echo "command.sh: $1 must be a positive integer, got '$2'" >&2
        exit 2
    fi
}
positive "nodes ($nodes_from)" "$nodes"
positive "ranks per node ($from)" "$gpus"

# TRAIN_ARGS as words: Python splits them (the job's python; torchrun needs it anyway) and hands
# them over NUL-separated, so no word is ever evaluated by this shell.
words="$(mktemp)"
python -c '
import os, shlex, sys
try:
    words = shlex.split(os.environ.get("TRAIN_ARGS", ""))
except ValueError as exc:
    sys.exit(f"command.sh: TRAIN_ARGS cannot be split into arguments: {exc}")
sys.stdout.write("".join(w + "\0" for w in words))
' > "$words" || { rm -f "$words"; exit 2; }
extra=()
while IFS= read -r -d '' word; do extra+=("$word"); done < "$words"
rm -f "$words"

# The wheel in the archive, unless this exact version is installed already (a retry on the same
# environment, or a local run from a checkout).
shopt -s nullglob
wheels=(wheels/uc_checkpoint-*.whl)
shopt -u nullglob
if [ "${#wheels[@]}" -eq 1 ]; then
    want="$(basename "${wheels[0]}" | cut -d- -f2)"
    have="$(python -c 'import importlib.metadata as m; print(m.version("uc-checkpoint"))' 2>/dev/null || true)"
    [ "$have" = "$want" ] || bash install_plugin.sh --quiet
else
    bash install_plugin.sh --quiet  # fails, naming what is missing
fi

echo "node ${NODE_RANK:-0} of $nodes, $gpus ranks ($from), rendezvous ${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}, checkpoints $root"
exec torchrun \
    --nnodes="$nodes" \
    --node-rank="${NODE_RANK:-0}" \
    --nproc-per-node="$gpus" \
    --master-addr="${MASTER_ADDR:-127.0.0.1}" \
    --master-port="${MASTER_PORT:-29500}" \
    train_fsdp.py --checkpoint-root "$root" ${extra[@]+"${extra[@]}"} "$@"
