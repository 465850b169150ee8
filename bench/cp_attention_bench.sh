#!/usr/bin/env bash
# The grid of bench/cp_attention_bench: sequences (default 1024 2048 4096
# 8192) at CP = 1 (full attention on one rank) and CP = 2, 4 for the three
# modes, each configuration in a process of its own (so that the peak
# memory is that configuration's). One intra-op thread per rank.
#   bench/cp_attention_bench.sh [build dir] [sequences...]
set -euo pipefail
build=${1:-build}
shift || true
seqs=${*:-1024 2048 4096 8192}
run="$build/bin/commgrad-run"
bench="$build/bin/cp_attention_bench"
printf '# %-7s %3s %6s %10s %10s %12s %12s\n' mode cp seq "ms(p50)" "peak MB" "MiB sent" "closed form"
for s in $seqs; do
  "$run" -n 1 "$bench" --seq "$s" --steps 3 | sed 's/^\[0\] //'
  for w in 2 4; do
    for m in allgather ring ulysses; do
      "$run" -n "$w" "$bench" --seq "$s" --mode "$m" --steps 3 | sed 's/^\[0\] //'
    done
  done
done
