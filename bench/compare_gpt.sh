#!/usr/bin/env bash
# The GPT step of commgrad (bench/gpt_bench, C++) beside the same model in
# Python PyTorch (bench/gpt_bench.py: torch.distributed.pipelining,
# parallelize_module, DDP; Gloo), both untied (pipelining cannot share a
# weight between stages) and one intra-op thread per rank, in alternating
# rounds so that machine noise falls on both alike (the order flips every
# round). Each job runs every default layout of its world size: at 2 ranks
# PP=2 1f1b, gpipe, interleaved (v = 2), TP=2, DP=2; at 4 ranks TP=2 x PP=2,
# PP=2 x DP=2, PP=4. Writes each run's output to OUTDIR and prints the
# medians over the rounds, commgrad / Python tokens/s per round, and the
# measured bubble against the closed form.
#
#   bench/compare_gpt.sh [-n "2 4"] [-r ROUNDS] [-o OUTDIR (default BUILDDIR/gpt_compare)] [--build BUILDDIR] [-- BENCH OPTIONS...]
#
# BENCH OPTIONS go to both programs (e.g. -- --steps 8 --layers 4). Needs
# gpt_bench and commgrad-run built in BUILDDIR (default: build, or
# $COMMGRAD_BUILD_DIR) and torch in $COMMGRAD_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="2 4"
rounds=3
out=""
build=${COMMGRAD_BUILD_DIR:-build}
venv=${COMMGRAD_VENV:-.venv}
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) ranks=$2; shift 2 ;;
    -r) rounds=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: $0 [-n \"2 4\"] [-r ROUNDS] [-o OUTDIR] [--build BUILDDIR] [-- BENCH OPTIONS...]" >&2; exit 2 ;;
  esac
done
for f in "$build/bin/commgrad-run" "$build/bin/gpt_bench" "$venv/bin/torchrun"; do
  [[ -x $f ]] || { echo "compare_gpt: $f is missing" >&2; exit 2; }
done
out=${out:-$build/gpt_compare}
mkdir -p "$out"
rm -f "$out"/cpp_n*_r*.txt "$out"/py_n*_r*.txt

cpp() {  # ranks round
  "$build/bin/commgrad-run" -n "$1" "$build/bin/gpt_bench" --untie "${extra[@]}" >"$out/cpp_n$1_r$2.txt"
}
py() {  # ranks round
  "$venv/bin/torchrun" --nproc-per-node "$1" --master-port $((20000 + RANDOM % 20000)) bench/gpt_bench.py \
    "${extra[@]}" >"$out/py_n$1_r$2.txt" 2>"$out/py_n$1_r$2.err"
}
for n in $ranks; do
  for r in $(seq 1 "$rounds"); do
    echo "compare_gpt: $n ranks, round $r/$rounds" >&2
    if (( r % 2 )); then cpp "$n" "$r"; py "$n" "$r"; else py "$n" "$r"; cpp "$n" "$r"; fi
  done
done
"$venv/bin/python" bench/gpt_bench.py --summarize "$out" | tee "$out/summary.md"
