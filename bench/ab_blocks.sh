#!/usr/bin/env bash
# An A/B of two variants of the shm engine inside the same processes: the
# engine runs variant A and variant B of the code under comparison in
# alternating blocks of collectives (see docs/shm.md, "Comparing two
# variants"), so a change of the host's vCPU placement hits both alike.
#
#   bench/ab_blocks.sh [-B BLOCK] [-r RUNS] [-n RANKS] [--rt] -- COMMGRAD_BENCH_ARGS...
#
# Configures (once) and builds commgrad-run and commgrad-bench in build-ab
# with COMMGRAD_SHM_AB_BLOCK=BLOCK (default 1024 collectives; pick it so
# that a block lasts 10-100 ms), runs commgrad-bench RUNS times (default 5)
# on RANKS ranks (default 2; --rt: under chrt -r 50, root only) and prints
# every rank's report, then the median over runs and ranks of B/A and of
# the A/A controls (v2/v0, v3/v1): a B/A outside the controls' spread is a
# difference. The code under comparison asks Comm::ab_runs_b().
# Example: bench/ab_blocks.sh -B 8 -n 4 -- --op broadcast -b 4M -e 4M -n 400 -w 5
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
block=1024 runs=5 ranks=2 rt=()
while [[ $# -gt 0 ]]; do
  case $1 in
    -B) block=$2; shift 2 ;;
    -r) runs=$2; shift 2 ;;
    -n) ranks=$2; shift 2 ;;
    --rt) rt=(chrt -r 50); shift ;;
    --) shift; break ;;
    *) echo "ab_blocks: unknown option '$1' (bench arguments go after --)" >&2; exit 2 ;;
  esac
done
if ! [[ $block =~ ^[1-9][0-9]*$ ]]; then
  echo "ab_blocks: the block must be a positive number of collectives, got '$block'" >&2
  exit 2
fi

dir=${COMMGRAD_AB_BUILD_DIR:-build-ab}
mkdir -p "$dir"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOMMGRAD_TORCH_LINE="$COMMGRAD_TORCH" \
  -DCMAKE_PREFIX_PATH="$(torch_prefix)" -DCOMMGRAD_SHM_AB_BLOCK="$block" \
  -DCOMMGRAD_BUILD_TESTS=OFF -DCOMMGRAD_BUILD_EXAMPLES=OFF -DCOMMGRAD_BUILD_BENCH=OFF >"$dir/configure.log" 2>&1 ||
  { cat "$dir/configure.log" >&2; exit 1; }
cmake --build "$dir" --target commgrad-run commgrad-bench >"$dir/build.log" 2>&1 ||
  { tail -n 40 "$dir/build.log" >&2; exit 1; }

reports=$(mktemp)
trap 'rm -f "$reports"' EXIT
for r in $(seq 1 "$runs"); do
  "${rt[@]}" "$dir/bin/commgrad-run" -n "$ranks" --no-prefix "$dir/bin/commgrad-bench" --backend shm --raw-only \
    "$@" 2>&1 >/dev/null | grep '^shm A/B ' | sed "s/^/run $r: /" | tee -a "$reports"
done
python3 - "$reports" <<'PY'
import re, statistics, sys
rows = [re.search(r"B/A ([0-9.]+), control v2/v0 ([0-9.]+) v3/v1 ([0-9.]+)", line) for line in open(sys.argv[1])]
rows = [tuple(float(x) for x in m.groups()) for m in rows if m]
if not rows:
    sys.exit("ab_blocks: no report came back (was the build configured with COMMGRAD_SHM_AB_BLOCK?)")
ba, c0, c1 = zip(*rows)
controls = c0 + c1
print(f"{len(rows)} reports: B/A median {statistics.median(ba):.3f} (min {min(ba):.3f}, max {max(ba):.3f}); "
      f"A/A controls median {statistics.median(controls):.3f} (min {min(controls):.3f}, max {max(controls):.3f})")
PY
