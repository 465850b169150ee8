#!/usr/bin/env bash
# C++ commgrad::fsdp::fully_shard (bench/zero_bench, which also times DDP,
# ZeRO-1 and ZeRO-2 in the same run) against Python's FSDP2
# (bench/fsdp2_bench.py: torch.distributed.fsdp.fully_shard) on the same
# model and step, on commgrad's shm transport (torch.distributed backend
# "commgrad" for Python) and on Gloo, one intra-op thread per rank. Each
# round runs both programs on each transport, the order flipping every
# round, so that a load that comes and goes falls on both. A background
# sampler records the load average every 5 s. Writes each run's output
# (cpp_<transport>_n<N>_r<round>.{txt,csv}, py_...) and the tables
# (summary.md: bench/fsdp2_bench.py --summarize) to OUTDIR.
#
#   bench/fsdp_compare.sh [-n "2 4"] [-r ROUNDS] [-t "shm gloo"] [-o OUTDIR] [--build BUILDDIR] [-- BENCH OPTIONS...]
#
# OUTDIR defaults to bench/results/fsdp/<date-time>. BENCH OPTIONS go to
# both programs (--layers 8 --width 512 --batch 32 --steps 15 by default).
# Builds nothing: needs zero_bench and commgrad-run in BUILDDIR (default
# build, or $COMMGRAD_BUILD_DIR) and torch with commgrad's Python package in
# $COMMGRAD_VENV (default .venv). The Python side loads BUILDDIR's commgrad
# libraries (put first on LD_LIBRARY_PATH, ahead of the package's runpath),
# so both sides run the same transport build.
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="2"
rounds=3
transports="shm gloo"
out=""
build=${COMMGRAD_BUILD_DIR:-build}
venv=${COMMGRAD_VENV:-.venv}
extra=()
usage="usage: $0 [-n \"2 4\"] [-r ROUNDS] [-t \"shm gloo\"] [-o OUTDIR] [--build BUILDDIR] [-- BENCH OPTIONS...]"
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) ranks=$2; shift 2 ;;
    -r) rounds=$2; shift 2 ;;
    -t) transports=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
for f in "$build/bin/commgrad-run" "$build/bin/zero_bench" "$venv/bin/torchrun"; do
  [[ -x $f ]] || { echo "fsdp_compare: $f is missing" >&2; exit 2; }
done
libs=$(cd "$build/src" && pwd)
export LD_LIBRARY_PATH="$libs/dist:$libs/backend:$libs/util${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for t in $transports; do
  case $t in
    shm) "$venv/bin/python" -c "import commgrad" ||
      { echo "fsdp_compare: commgrad's Python package is not in $venv (scripts/build.sh installs it)" >&2; exit 2; } ;;
    gloo) ;;
    *) echo "fsdp_compare: transport '$t': shm or gloo" >&2; exit 2 ;;
  esac
done
out=${out:-bench/results/fsdp/$(date +%Y-%m-%d-%H%M)}
mkdir -p "$out"
rm -f "$out"/cpp_*_n*_r*.* "$out"/py_*_n*_r*.* "$out/loadavg.txt"

# One intra-op thread per rank (commgrad-run's default; torchrun's too, said here for both).
export OMP_NUM_THREADS=1
(while :; do echo "$(date +%s) $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/loadavg.txt"; sleep 5; done) &
sampler=$!
trap 'kill "$sampler" 2>/dev/null || true' EXIT

cpp() {  # transport ranks round
  local name="$out/cpp_$1_n$2_r$3"
  COMMGRAD_BACKEND=$1 "$build/bin/commgrad-run" -n "$2" "$build/bin/zero_bench" --times "$name.csv" \
    "${extra[@]}" >"$name.txt" 2>&1
}
py() {  # transport ranks round
  local name="$out/py_$1_n$2_r$3" backend=$1
  [[ $backend == shm ]] && backend=commgrad
  "$venv/bin/torchrun" --nproc-per-node "$2" --master-port $((20000 + RANDOM % 20000)) bench/fsdp2_bench.py \
    --backend "$backend" --times "$name.csv" "${extra[@]}" >"$name.txt" 2>"$name.err"
  [[ -s $name.err ]] || rm -f "$name.err"
}
for n in $ranks; do
  for r in $(seq 1 "$rounds"); do
    for t in $transports; do
      echo "fsdp_compare: $n ranks, $t, round $r/$rounds" >&2
      if (( r % 2 )); then cpp "$t" "$n" "$r"; py "$t" "$n" "$r"; else py "$t" "$n" "$r"; cpp "$t" "$n" "$r"; fi
    done
  done
done
kill "$sampler" 2>/dev/null || true
"$venv/bin/python" bench/fsdp2_bench.py --summarize "$out" | tee "$out/summary.md"
