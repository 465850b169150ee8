#!/usr/bin/env bash
# The collectives (float32; SUM where they reduce) on this machine over every
# transport at hand, side by side in one run: commgrad-bench's raw transport
# call over Gloo and over shm and, when OpenMPI's mpicc and mpirun are
# installed, OpenMPI's own call (bench/mpi_collectives.c) timed the same way
# over the same sizes (each program times its call alone, back to back:
# commgrad-bench --raw-only). Next to all_reduce, the copy floor: the time the
# bytes each rank must read and write take at this machine's copy bandwidth,
# measured in the same run by bench/copy_floor.c with every rank copying at
# once (a transport that stages through shared memory reads and writes
# (5n-2)/(2n) times the tensor per rank, at least: copy in, reduce a slice,
# copy out; so 2.0 memcpy times at 2 ranks, 2.25 at 4). Rounds alternate the
# transports (round 1: gloo, shm, mpi for every collective; round 2: the same
# again, ...) and the tables show the median over rounds, so that a burst of
# load from outside hits every transport alike. Writes the raw outputs
# (OP_nN_TRANSPORT.txt, OP without underscores) and, by
# `bench/plot_results.py --run`, summary.md (a table per collective and rank
# count) and one SVG plot of bus bandwidth against size per collective.
# machine.txt records the CPU, the load and, before and after the runs, the
# spread of the cross-core round trip (bench/core_latency.c); every program's
# output gets the median round trip of the moment before and after it
# ("# placement before: ... ns"): on a VM whose host moves the vCPUs (this
# one: about 40, 125 or 430 ns, where every transport's cross-core copies
# run 4-5x slower) it says which placement each result met, and the time
# the host took from the vCPUs while it ran ("# host: steal N ms over the
# program", /proc/stat). summary.md lists every round in which shm trailed
# OpenMPI at some size, with those two beside it.
#
#   bench/compare_transports.sh [-n "2 4"] [--op "all_reduce ..."|all] [-b 4K] [-e 256M] [-f 4]
#                               [-i ITERS] [-w WARMUP] [-s SWEEPS] [-r ROUNDS] [--rt] [--fresh]
#                               [-o OUTDIR] [--build BUILDDIR]
#
# -s: each program sweeps the sizes SWEEPS times and reports each size's
# median over its sweeps (default 1), which spreads every size over the
# placements a VM's host switches between within seconds.
#
# --fresh: before each call, untimed, every rank writes what the call
# reads again (commgrad-bench --fresh-input, mpi_collectives' FRESH), as a
# training step's tensors are freshly written; without it a source
# unchanged since the last call may still sit in the readers' caches,
# which flatters a transport that reads it in place (OpenMPI's single
# copy) at the sizes that fit in cache.
#
# --op: all_reduce (the default), all_gather, reduce_scatter, broadcast,
# all_to_all, or all of them. Sizes count as commgrad-bench's (nccl-tests'):
# all_gather's output, reduce_scatter's input, all_to_all's buffer per rank.
# --rt runs every program under chrt -r 50 (root only): the ranks then
# preempt other work on a shared machine (the numbers of a quiet machine,
# within the kernel's 95% real-time budget).
#
# Needs commgrad-run and commgrad-bench built in BUILDDIR (default: build, or
# $COMMGRAD_BUILD_DIR):  cmake --build build --target commgrad-run commgrad-bench
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="2 4"
ops=all_reduce
min=4K
max=256M
factor=4
iters=20
warmup=5
sweeps=1
rounds=3
rt=()
fresh=0
out=bench/results/transports/$(date +%Y-%m-%d)  # a run folder beside the earlier runs
build=${COMMGRAD_BUILD_DIR:-build}
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) ranks=$2; shift 2 ;;
    --op) ops=$2; shift 2 ;;
    -b) min=$2; shift 2 ;;
    -e) max=$2; shift 2 ;;
    -f) factor=$2; shift 2 ;;
    -i) iters=$2; shift 2 ;;
    -w) warmup=$2; shift 2 ;;
    -s) sweeps=$2; shift 2 ;;
    -r) rounds=$2; shift 2 ;;
    --rt) rt=(chrt -r 50); shift ;;
    --fresh) fresh=1; shift ;;
    -o) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '2,49p' "$0"; exit 0 ;;
    *) echo "compare_transports.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

bytes() {  # 4K -> 4096
  local v=$1 mult=1
  case $v in
    *K) mult=1024; v=${v%K} ;;
    *M) mult=$((1024 * 1024)); v=${v%M} ;;
    *G) mult=$((1024 * 1024 * 1024)); v=${v%G} ;;
  esac
  echo $((v * mult))
}

fresh_flag=()
[[ $fresh == 1 ]] && fresh_flag=(--fresh-input)

all_ops="all_reduce all_gather reduce_scatter broadcast all_to_all"
[[ $ops == all ]] && ops=$all_ops
for op in $ops; do
  [[ " $all_ops " == *" $op "* ]] || { echo "compare_transports.sh: unknown --op '$op' (one of: $all_ops, all)" >&2; exit 2; }
done

run=$build/bin/commgrad-run
bench=$build/bin/commgrad-bench
for tool in "$run" "$bench"; do
  [[ -x $tool ]] || { echo "compare_transports.sh: $tool is missing; build it first" >&2; exit 1; }
done
mkdir -p "$out"

have_mpi=0
mpi_bin=$(mktemp -d)/mpi_collectives  # the binaries stay out of the results
trap 'rm -rf "$(dirname "$mpi_bin")"' EXIT
if command -v mpicc > /dev/null && command -v mpirun > /dev/null; then
  mpicc -O2 -o "$mpi_bin" bench/mpi_collectives.c
  have_mpi=1
else
  echo "compare_transports.sh: no mpicc/mpirun (OpenMPI: apt-get install openmpi-bin libopenmpi-dev); comparing gloo and shm only" >&2
fi
mpi_flags=(--oversubscribe --bind-to none)
[[ $(id -u) == 0 ]] && mpi_flags+=(--allow-run-as-root)

{
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'))"
  echo "# load average before the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$out/machine.txt"

floor_bin=$(dirname "$mpi_bin")/copy_floor
cc -O2 -o "$floor_bin" bench/copy_floor.c -lpthread
latency_bin=$(dirname "$mpi_bin")/core_latency
cc -O2 -o "$latency_bin" bench/core_latency.c
[[ $(nproc) -ge 2 ]] && "$latency_bin" 3 >> "$out/machine.txt"
# Appends the placement of the moment to $1 as a comment (the tables skip
# comments): the median cross-core round trip over half a second.
placement() {
  [[ $(nproc) -ge 2 ]] || return 0
  echo "# placement $2: cross-core round trip median $("$latency_bin" 0.5 | sed -n 's/.*median \([0-9]*\).*/\1/p') ns" >> "$1"
}
# The time the host took from this VM's vCPUs (/proc/stat's steal, every
# CPU together), in ms since boot: around each program, so that a round the
# host slowed can be told from one the transport lost.
ticks_per_s=$(getconf CLK_TCK)
steal_ms() { awk -v hz="$ticks_per_s" '/^cpu /{print int($9 * 1000 / hz)}' /proc/stat; }
# Appends the steal since $2 (steal_ms's value before the program) to $1.
steal() { echo "# host: steal $(($(steal_ms) - $2)) ms over the program" >> "$1"; }
rm -f "$out"/*_n*_*.txt
for round in $(seq "$rounds"); do
  for n in $ranks; do
    for op in $ops; do
      file=$out/${op//_/}_n$n  # allreduce_n2
      for backend in gloo shm; do
        echo "== round $round: $op, $n ranks, $backend" >&2
        placement "${file}_$backend.txt" before
        stolen=$(steal_ms)
        "${rt[@]}" "$run" -n "$n" --no-prefix --timeout 3600 "$bench" --backend "$backend" --op "$op" \
          -b "$min" -e "$max" -f "$factor" -n "$iters" -w "$warmup" --sweeps "$sweeps" --raw-only \
          "${fresh_flag[@]}" |
          tee -a "${file}_$backend.txt"
        steal "${file}_$backend.txt" "$stolen"
        placement "${file}_$backend.txt" after
      done
      if [[ $have_mpi == 1 ]]; then
        echo "== round $round: $op, $n ranks, OpenMPI" >&2
        placement "${file}_mpi.txt" before
        stolen=$(steal_ms)
        "${rt[@]}" mpirun "${mpi_flags[@]}" -n "$n" "$mpi_bin" "$op" "$(bytes "$min")" "$(bytes "$max")" "$factor" \
          "$iters" "$warmup" "$sweeps" "$fresh" | tee -a "${file}_mpi.txt"
        steal "${file}_mpi.txt" "$stolen"
        placement "${file}_mpi.txt" after
      fi
    done
    if [[ " $ops " == *" all_reduce "* ]]; then
      echo "== round $round: copy floor, $n ranks" >&2
      "${rt[@]}" "$floor_bin" "$n" "$(bytes "$min")" "$(bytes "$max")" "$factor" "$iters" | tee -a "$out/copy_floor_n${n}.txt"
    fi
  done
done
echo "# load average after the runs: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/machine.txt"
[[ $(nproc) -ge 2 ]] && "$latency_bin" 3 >> "$out/machine.txt"

python3 bench/plot_results.py --run "$out"
echo "compare_transports.sh: results in $out/ (summary.md, *_busbw.svg)" >&2
