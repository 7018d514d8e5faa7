#!/usr/bin/env bash
# Two nodes, one torchrun per node, each starting this node's ranks of examples/torch_loop.py.
#
# On real machines (run the same line on every node; HEAD is node 0's address):
#   HEAD=10.0.0.1 NNODES=2 GPUS=8 bash examples/two_nodes.sh --stage 3
# Simulated on one host (both "nodes" here, one CPU rank each over gloo; what CI runs):
#   SIMULATE=1 bash examples/two_nodes.sh --stage 2 --steps 20
#
# --rdzv-backend c10d: the ranks meet at HEAD:PORT (a TCP store on node 0's agent); the
# agents assign node ranks themselves, so the same command runs everywhere. On GPUs torchrun
# starts GPUS ranks per node and zk.init_distributed() picks NCCL; ZeroAdamW shards over all
# NNODES x GPUS ranks (the default process group), nothing else changes in the script.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PORT="${PORT:-29517}"
if [[ "${SIMULATE:-0}" == "1" ]]; then
    for node in 0 1; do
        torchrun --nnodes 2 --node-rank "$node" --nproc-per-node 1 \
            --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id zk-example \
            "$here/torch_loop.py" "$@" &
    done
    status=0
    for job in $(jobs -p); do wait "$job" || status=$?; done
    exit "$status"
fi
: "${HEAD:?set HEAD to node 0's address (or SIMULATE=1 to run both nodes here)}"
exec torchrun --nnodes "${NNODES:-2}" --nproc-per-node "${GPUS:-1}" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id zk-example \
    "$here/torch_loop.py" "$@"
