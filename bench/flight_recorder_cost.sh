#!/usr/bin/env bash
# The flight recorder's cost on small all_reduces: commgrad-bench's
# differentiable all_reduce with the recorder off (COMMGRAD_TRACE_BUFFER_SIZE=0)
# and on (the default ring), in alternating rounds so that the machine's load
# drifts into both alike. The raw transport call (never recorded) is the
# control: its off/on difference is the noise. Then the recorder's own cost
# per collective (flight_recorder_bench: the notes ops makes, in a loop, off
# and on, alternating), which a loaded machine blurs far less. Prints markdown
# tables of the medians over the rounds and keeps every raw output in OUTDIR.
#
#   bench/flight_recorder_cost.sh [-n RANKS] [-r ROUNDS] [--backend B] [-i ITERS] [-o OUTDIR] [--build BUILDDIR]
#
# Needs commgrad-run and commgrad-bench built in BUILDDIR (default: build, or
# $COMMGRAD_BUILD_DIR):  cmake --build build --target commgrad-run commgrad-bench flight_recorder_bench
set -euo pipefail
cd "$(dirname "$0")/.."

ranks=2
rounds=10
backend=shm
iters=2000
out=bench/results/flight_recorder/$(date +%Y-%m-%d)
build=${COMMGRAD_BUILD_DIR:-build}
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) ranks=$2; shift 2 ;;
    -r) rounds=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    -i) iters=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    *) echo "flight_recorder_cost.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
for ((round = 0; round < rounds; round++)); do
  for mode in off on; do
    size=$([[ $mode == off ]] && echo 0 || echo "")
    COMMGRAD_TRACE_BUFFER_SIZE=$size "$build/bin/commgrad-run" -n "$ranks" "$build/bin/commgrad-bench" \
      --op all_reduce --backend "$backend" -b 8 -e 4K -f 8 -n "$iters" -w 200 --no-backward \
      >"$out/$mode-$round.txt"
  done
done
for ((round = 0; round < rounds; round++)); do
  COMMGRAD_TRACE_BUFFER_SIZE=0 "$build/bin/flight_recorder_bench" >"$out/self-off-$round.txt"
  COMMGRAD_TRACE_BUFFER_SIZE= "$build/bin/flight_recorder_bench" >"$out/self-on-$round.txt"
done
python3 - "$out" "$rounds" <<'PY'
import glob, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
times = {}  # (mode, size) -> ([raw], [op])
for mode in ("off", "on"):
    for path in glob.glob(f"{out}/{mode}-*.txt"):
        for line in open(path):
            if line.startswith("[0]"):
                line = line[3:]
            if line.lstrip().startswith("#") or "|" not in line:
                continue
            cols = line.split("|")
            size = int(cols[0].split()[0])
            raw, op = float(cols[1].split()[0]), float(cols[2].split()[0])
            t = times.setdefault((mode, size), ([], []))
            t[0].append(raw)
            t[1].append(op)
print(f"| size (B) | op, recorder off (us) | op, on (us) | op: on vs off | raw call, off (us) | raw, on (us) | raw: on vs off |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for size in sorted({s for _, s in times}):
    off, on = times[("off", size)], times[("on", size)]
    m = [statistics.median(x) for x in (off[1], on[1], off[0], on[0])]
    print(f"| {size} | {m[0]:.2f} | {m[1]:.2f} | {100 * (m[1] / m[0] - 1):+.1f}% | {m[2]:.2f} | {m[3]:.2f} | "
          f"{100 * (m[3] / m[2] - 1):+.1f}% |")
print(f"\n({rounds} rounds each, alternating; medians over the rounds of each round's p50)")
self = {}
for mode in ("off", "on"):
    for path in glob.glob(f"{out}/self-{mode}-*.txt"):
        self.setdefault(mode, []).append(float(open(path).read().split(":")[1].split()[0]))
off, on = statistics.median(self["off"]), statistics.median(self["on"])
print("\n| recorder's own cost per collective | ring off (ns) | ring on (ns) | added (ns) |")
print("|---|---:|---:|---:|")
print(f"| issued + on the transport + finished | {off:.1f} | {on:.1f} | {on - off:.1f} |")
PY
