#!/usr/bin/env bash
# The device run, one command on a CUDA machine (docs/gpu.md, "On a CUDA machine"): the gpu
# tests, then the GPU benchmarks. Every step runs even when one before it failed (a GPU lease
# is short: one run should bring back everything); the exit status is the first failure's.
#   bash tests/gpu/run_gpu.sh            # all gpu tests (the two `large` ones need ~40 GiB)
#   ZK_GPU_MARK="gpu and not large" bash tests/gpu/run_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
rc=0
step() {
  echo "+ $*"
  "$@"
  local s=$?
  if [ "$s" -ne 0 ] && [ "$rc" -eq 0 ]; then rc=$s; fi
}
step python -m pytest -m "${ZK_GPU_MARK:-gpu}" -rs -q
step python -m zerokern bench --kernels --device cuda
step python -m zerokern bench --step --device cuda
exit "$rc"
