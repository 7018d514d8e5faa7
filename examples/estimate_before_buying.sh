#!/usr/bin/env bash
# How many GPUs, of what size, before you buy or rent them: `zerokern estimate` builds the model
# on the meta device (nothing allocated, no download for a local config.json) and prints the
# bytes per rank zerokern will hold, for each stage, beside DESIGN's formula and DeepSpeed's.
# The figures are exact for zerokern's layout: equal to opt.memory_report() after a step.
#
#   bash examples/estimate_before_buying.sh                         # Llama-2-7B shape, 8 GPUs
#   bash examples/estimate_before_buying.sh path/to/config.json 16  # your model, 16 GPUs
#
# Model states only: add activations (batch x sequence x layers; activation checkpointing
# shrinks them) and the framework's workspace (a few GiB on a GPU) before comparing with the
# card's memory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
MODEL="${1:-$here/configs/llama-7b.json}"   # a HF config (JSON / dir / hub name), a preset, or
GPUS="${2:-8}"                             # module:function; --params 7e9 for a bare count

echo "== stages 0-3 on $GPUS GPUs, bf16 (master, m, v fp32) =="
zerokern estimate --model "$MODEL" --world-size "$GPUS" --precision bf16

echo
echo "== stage 3 with the optimizer state in host RAM (offload=\"cpu\") =="
zerokern estimate --model "$MODEL" --world-size "$GPUS" --stage 3 --offload cpu

echo
echo "== ZeRO-Infinity: optimizer state and param shards on NVMe (one GPU) =="
zerokern estimate --model "$MODEL" --world-size 1 --stage 3 --offload nvme --offload-params nvme
