#!/usr/bin/env bash
# The AI Runtime task runs this on every node (deployments[].command_path). It starts one torchrun
# agent per node from the variables the runtime sets, and torchrun starts one rank per GPU:
#   NODE_RANK                    this node, 0 .. nodes - 1                    (default 0)
#   NUM_NODES, else WORLD_SIZE   the number of nodes (the runtime's WORLD_SIZE counts nodes)
#   MASTER_ADDR, MASTER_PORT     node 0's address and port for the rendezvous (default 127.0.0.1:29500)
#   GPUS_PER_NODE                ranks per node (default: the GPUs nvidia-smi lists; 1 without GPUs)
#   CODE_SOURCE_PATH             where the code archive was unpacked (required)
#   UC_CHECKPOINT_ROOT           checkpoint root, /Volumes/<catalog>/<schema>/<volume>/<run> (required)
#   TRAIN_ARGS                   more arguments for train_fsdp.py (optional)
# Node-local staging: $UC_CHECKPOINT_STAGING_DIR if set, else the system temp dir.
set -euo pipefail

cd "${CODE_SOURCE_PATH:?CODE_SOURCE_PATH is not set: it names the unpacked code directory}"
root="${UC_CHECKPOINT_ROOT:?UC_CHECKPOINT_ROOT is not set: give the checkpoint root, /Volumes/<catalog>/<schema>/<volume>/<run>}"
nodes="${NUM_NODES:-${WORLD_SIZE:-1}}"
gpus="${GPUS_PER_NODE:-$( (nvidia-smi --list-gpus 2>/dev/null || true) | wc -l)}"
[ "$gpus" -ge 1 ] || gpus=1
read -r -a extra <<< "${TRAIN_ARGS:-}"

echo "node ${NODE_RANK:-0} of $nodes, $gpus ranks, rendezvous ${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}, checkpoints $root"
exec torchrun \
    --nnodes="$nodes" \
    --node-rank="${NODE_RANK:-0}" \
    --nproc-per-node="$gpus" \
    --master-addr="${MASTER_ADDR:-127.0.0.1}" \
    --master-port="${MASTER_PORT:-29500}" \
    train_fsdp.py --checkpoint-root "$root" ${extra[@]+"${extra[@]}"} "$@"
