#!/usr/bin/env bash
# README command 1: install what is missing, build, and run the main job:
# the founding example on 4 local ranks, then the tensor-parallel checks.
# On the default LibTorch line (COMMGRAD_TORCH=system for Debian's 1.13).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
scripts/deps.sh
scripts/build.sh commgrad-run tp_autograd_comm megatron_ffn

bin=$build_dir/bin
echo "== $("$bin/commgrad-run" --version)"
echo "== founding example: AllReduce forward and backward on 4 ranks"
"$bin/commgrad-run" -n 4 --timeout 120 "$bin/tp_autograd_comm"
for n in 1 2 4; do
  echo "== tensor-parallel checks: Megatron FFN at TP=$n against one rank"
  "$bin/commgrad-run" -n "$n" --timeout 300 "$bin/megatron_ffn"
done
echo "main job: OK"
