#!/usr/bin/env bash
# README command 1: install what is missing, build, and run the main job:
# the founding example on 4 local ranks, then the tensor-parallel checks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
examples=(tp_autograd_comm)
[[ -f examples/megatron_ffn.cpp ]] && examples+=(megatron_ffn)
scripts/build.sh commgrad-run "${examples[@]}"

run=build/bin/commgrad-run
echo "== founding example: AllReduce forward and backward on 4 ranks"
$run -n 4 --timeout 120 build/bin/tp_autograd_comm
if [[ -x build/bin/megatron_ffn ]]; then
  for n in 1 2 4; do
    echo "== tensor-parallel checks: Megatron FFN at TP=$n against one rank"
    $run -n "$n" --timeout 300 build/bin/megatron_ffn
  done
fi
echo "main job: OK"
