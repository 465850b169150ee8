#!/usr/bin/env bash
# all_reduce (float32, SUM) on this machine over every transport at hand,
# side by side in one run: commgrad-bench's raw transport call over Gloo and
# over shm and, when OpenMPI's mpicc and mpirun are installed, a plain
# MPI_Allreduce (bench/mpi_allreduce.c) timed the same way over the same
# sizes (each program times its call alone, back to back: commgrad-bench
# --raw-only); next to them the copy floor: the time the bytes each rank must
# read and write take at this machine's copy bandwidth, measured in the same
# run by bench/copy_floor.c with every rank copying at once (a transport
# that stages through shared memory reads and writes (5n-2)/(2n) times the
# tensor per rank, at least: copy in, reduce a slice, copy out; so 2.0
# memcpy times at 2 ranks, 2.25 at 4). Rounds alternate the transports
# (round 1: gloo, shm, mpi; round 2: the same again, ...) and the tables
# show the median over rounds, so that a burst of load from outside hits
# every transport alike. Writes, per rank count, the raw outputs, one
# markdown table and one SVG plot of bus bandwidth against size (plus a PNG
# when gnuplot is installed).
#
#   bench/compare_transports.sh [-n "2 4"] [-b 4K] [-e 256M] [-f 4] [-i ITERS] [-w WARMUP]
#                               [-r ROUNDS] [--rt] [-o OUTDIR] [--build BUILDDIR]
#
# --rt runs every program under chrt -r 50 (root only): the ranks then
# preempt other work on a shared machine (the numbers of a quiet machine,
# within the kernel's 95% real-time budget).
#
# Needs commgrad-run and commgrad-bench built in BUILDDIR (default: build, or
# $COMMGRAD_BUILD_DIR):  cmake --build build --target commgrad-run commgrad-bench
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="2 4"
min=4K
max=256M
factor=4
iters=20
warmup=5
rounds=3
rt=()
out=bench/results/transports/$(date +%Y-%m-%d)  # a run folder beside the earlier runs
build=${COMMGRAD_BUILD_DIR:-build}
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) ranks=$2; shift 2 ;;
    -b) min=$2; shift 2 ;;
    -e) max=$2; shift 2 ;;
    -f) factor=$2; shift 2 ;;
    -i) iters=$2; shift 2 ;;
    -w) warmup=$2; shift 2 ;;
    -r) rounds=$2; shift 2 ;;
    --rt) rt=(chrt -r 50); shift ;;
    -o) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
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

run=$build/bin/commgrad-run
bench=$build/bin/commgrad-bench
for tool in "$run" "$bench"; do
  [[ -x $tool ]] || { echo "compare_transports.sh: $tool is missing; build it first" >&2; exit 1; }
done
mkdir -p "$out"

have_mpi=0
mpi_bin=$(mktemp -d)/mpi_allreduce  # the binaries stay out of the results
trap 'rm -rf "$(dirname "$mpi_bin")"' EXIT
if command -v mpicc > /dev/null && command -v mpirun > /dev/null; then
  mpicc -O2 -o "$mpi_bin" bench/mpi_allreduce.c
  have_mpi=1
else
  echo "compare_transports.sh: no mpicc/mpirun (OpenMPI); comparing gloo and shm only" >&2
fi
mpi_flags=(--oversubscribe --bind-to none)
[[ $(id -u) == 0 ]] && mpi_flags+=(--allow-run-as-root)

{
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'))"
  echo "# load average before the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$out/machine.txt"

floor_bin=$(dirname "$mpi_bin")/copy_floor
cc -O2 -o "$floor_bin" bench/copy_floor.c -lpthread
rm -f "$out"/allreduce_n*_*.txt "$out"/copy_floor_n*.txt
for round in $(seq "$rounds"); do
  for n in $ranks; do
    for backend in gloo shm; do
      echo "== round $round: all_reduce, $n ranks, $backend" >&2
      "${rt[@]}" "$run" -n "$n" --no-prefix --timeout 3600 "$bench" --backend "$backend" --op all_reduce \
        -b "$min" -e "$max" -f "$factor" -n "$iters" -w "$warmup" --raw-only | tee -a "$out/allreduce_n${n}_${backend}.txt"
    done
    if [[ $have_mpi == 1 ]]; then
      echo "== round $round: all_reduce, $n ranks, OpenMPI" >&2
      "${rt[@]}" mpirun "${mpi_flags[@]}" -n "$n" "$mpi_bin" "$(bytes "$min")" "$(bytes "$max")" "$factor" "$iters" "$warmup" \
        | tee -a "$out/allreduce_n${n}_mpi.txt"
    fi
    echo "== round $round: copy floor, $n ranks" >&2
    "${rt[@]}" "$floor_bin" "$n" "$(bytes "$min")" "$(bytes "$max")" "$factor" "$iters" | tee -a "$out/copy_floor_n${n}.txt"
  done
done
echo "# load average after the runs: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/machine.txt"

python3 - "$out" $ranks << 'EOF'
import math, os, statistics, sys

out, ranks = sys.argv[1], sys.argv[2:]
names = [("gloo", "Gloo"), ("shm", "shm"), ("mpi", "OpenMPI")]

def busbw(size, t_us, n):
    return size / t_us / 1e3 * 2 * (n - 1) / n if t_us > 0 else 0.0

def parse(path, n):
    """size -> (median time_us over the rounds, busbw) from the raw-transport columns."""
    times = {}
    if not os.path.exists(path):
        return {}
    for line in open(path):
        if line.startswith("#") or "|" not in line:
            continue
        left, raw = line.split("|")[:2]
        times.setdefault(int(left.split()[0]), []).append(float(raw.split()[0]))
    return {s: (statistics.median(t), busbw(s, statistics.median(t), n)) for s, t in times.items()}

def parse_floor(path, n):
    """size -> (floor time_us, busbw): (5n-2)/(2n) memcpy times of the median copy."""
    times = {}
    if not os.path.exists(path):
        return {}
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        size, t = line.split()[:2]
        times.setdefault(int(size), []).append(float(t))
    copies = (5 * n - 2) / (2 * n)
    return {s: (copies * statistics.median(t), busbw(s, copies * statistics.median(t), n)) for s, t in times.items()}

def human(b):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b // scale} {unit}"
    return f"{b} B"

def svg(path, n, series):
    W, H, L, R, T, B = 640, 400, 70, 150, 30, 50
    pts = [(s, v[1]) for _, rows in series for s, v in rows.items()]
    if not pts:
        return
    xs = sorted({s for s, _ in pts})
    x0, x1 = math.log2(xs[0]), math.log2(xs[-1]) or 1
    if x1 == x0:
        x1 = x0 + 1
    ymax = max(b for _, b in pts) * 1.1 or 1
    X = lambda s: L + (math.log2(s) - x0) / (x1 - x0) * (W - L - R)
    Y = lambda b: H - B - b / ymax * (H - T - B)
    colors = {"Gloo": "#d62728", "shm": "#1f77b4", "OpenMPI": "#2ca02c", "copy floor": "#7f7f7f"}
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{L}" y="18" font-size="14">all_reduce float32, {n} ranks: bus bandwidth (GB/s) against size</text>',
         f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="black"/>',
         f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="black"/>']
    for s in xs:
        o.append(f'<text x="{X(s):.1f}" y="{H-B+16}" text-anchor="middle">{human(s).replace(" ", "")}</text>')
    for k in range(6):
        b = ymax * k / 5
        o.append(f'<line x1="{L-4}" y1="{Y(b):.1f}" x2="{W-R}" y2="{Y(b):.1f}" stroke="#ddd"/>')
        o.append(f'<text x="{L-8}" y="{Y(b)+4:.1f}" text-anchor="end">{b:.2f}</text>')
    for i, (label, rows) in enumerate(series):
        if not rows:
            continue
        c = colors.get(label, "black")
        line = " ".join(f"{X(s):.1f},{Y(v[1]):.1f}" for s, v in sorted(rows.items()))
        o.append(f'<polyline points="{line}" fill="none" stroke="{c}" stroke-width="2"/>')
        for s, v in rows.items():
            o.append(f'<circle cx="{X(s):.1f}" cy="{Y(v[1]):.1f}" r="3" fill="{c}"/>')
        o.append(f'<line x1="{W-R+15}" y1="{T+20*i+10}" x2="{W-R+40}" y2="{T+20*i+10}" stroke="{c}" stroke-width="2"/>')
        o.append(f'<text x="{W-R+46}" y="{T+20*i+14}">{label}</text>')
    o.append("</svg>")
    open(path, "w").write("\n".join(o) + "\n")

md = [open(os.path.join(out, "machine.txt")).read().strip().replace("# ", "").replace("\n", "; "), ""]
for n in ranks:
    series = [(label, parse(os.path.join(out, f"allreduce_n{n}_{key}.txt"), int(n))) for key, label in names]
    series.append(("copy floor", parse_floor(os.path.join(out, f"copy_floor_n{n}.txt"), int(n))))
    present = [(l, r) for l, r in series if r]
    sizes = sorted({s for _, r in present for s in r})
    md.append(f"all_reduce float32, {n} ranks: time per call (us; the median over the rounds of each round's median) "
              "and bus bandwidth (GB/s)")
    md.append("")
    head = "| size | " + " | ".join(f"{l} time | {l} busbw" for l, _ in present)
    rows = dict(series)
    extra = []
    if rows.get("shm") and rows.get("Gloo"):
        extra.append(("shm vs Gloo", "Gloo"))
    if rows.get("shm") and rows.get("OpenMPI"):
        extra.append(("shm vs OpenMPI", "OpenMPI"))
    if rows.get("shm") and rows.get("copy floor"):
        extra.append(("shm / floor", "copy floor"))
    head += "".join(f" | {name}" for name, _ in extra) + " |"
    md.append(head)
    md.append("|" + "---|" * (1 + 2 * len(present) + len(extra)))
    for s in sizes:
        cells = [human(s)]
        for _, r in present:
            t, b = r.get(s, (float("nan"), float("nan")))
            cells += [f"{t:.1f}", f"{b:.3f}"]
        for _, other in extra:
            a, o = rows["shm"].get(s), rows[other].get(s)
            if other == "copy floor":
                cells.append(f"{a[0] / o[0]:.2f}x" if a and o and o[0] > 0 else "")
            else:
                cells.append(f"{o[0] / a[0]:.2f}x faster" if a and o and a[0] > 0 else "")
        md.append("| " + " | ".join(cells) + " |")
    md.append("")
    svg(os.path.join(out, f"allreduce_busbw_n{n}.svg"), n, series)
    md.append(f"![busbw, {n} ranks](allreduce_busbw_n{n}.svg)")
    md.append("")
open(os.path.join(out, "allreduce.md"), "w").write("\n".join(md))
print("\n".join(md))
EOF

if command -v gnuplot > /dev/null; then
  for n in $ranks; do
    files=()
    for key in gloo shm mpi; do
      [[ -s $out/allreduce_n${n}_${key}.txt ]] && files+=("$key")
    done
    plot=""
    for key in "${files[@]}"; do
      plot+="${plot:+, }'< grep -v \"^#\" $out/allreduce_n${n}_${key}.txt' using 1:(\$9) with linespoints title '$key'"
    done
    gnuplot -e "set terminal pngcairo size 800,500; set output '$out/allreduce_busbw_n${n}.png';
      set logscale x 2; set xlabel 'bytes'; set ylabel 'busbw (GB/s)';
      set title 'all_reduce float32, $n ranks'; plot $plot" || true
  done
fi
echo "compare_transports.sh: results in $out/ (allreduce.md, allreduce_busbw_n*.svg)" >&2
