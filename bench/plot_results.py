#!/usr/bin/env python3
"""Draws the plots of docs/benchmarks.md from the raw results in bench/results.

    python3 bench/plot_results.py [--results bench/results] [--out docs/images] [--tables]
    python3 bench/plot_results.py --run DIR

Writes (plain SVG, Python's standard library only):
  OUT/busbw_allreduce.svg  all_reduce float32 bus bandwidth against size, one
      panel per rank count, for shm, Gloo and OpenMPI (commgrad-bench's raw
      transport call and bench/mpi_collectives.c) and the copy floor, plus
      commgrad's differentiable ops::all_reduce over shm when the runs timed
      it. Read from the newest session of bench/compare_transports.sh
      outputs, RESULTS/transports/runN*/ (the highest N; every folder of that
      N is one run of the session): the line is the median over the
      session's runs, the band their min-max.
  OUT/vs_python.svg  commgrad's throughput over Python PyTorch's, per round
      and as the ratio of the medians: the tensor-parallel MLP
      (RESULTS/tp_mlp/*.csv, the newest file by name) and the GPT
      (RESULTS/gpt/*/summary.md, the newest folder by name, as
      bench/compare_gpt.sh writes it).
With --tables, prints the markdown tables of docs/benchmarks.md's collectives
section computed from the same files. With --run DIR, summarises one
compare_transports.sh run (what the script calls when it ends): for every
collective in DIR, a table per rank count (each transport's median time and
bus bandwidth, shm's ratios) into DIR/summary.md, and DIR/OP_busbw.svg; where
the outputs carry their placement (compare_transports.sh's "# placement
before/after" lines), also shm against OpenMPI within each placement: only
the programs whose round trip before and after fell in the same class.
"""

import argparse
import csv
import glob
import math
import os
import re
import statistics

COLORS = {"shm": "#1f77b4", "Gloo": "#d62728", "OpenMPI": "#2ca02c", "copy floor": "#7f7f7f"}
OP_COLOR = "#9467bd"  # commgrad's differentiable op over shm
TRANSPORTS = (("shm", "shm"), ("Gloo", "gloo"), ("OpenMPI", "mpi"))  # (label, file key)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def results_file(run_dir, op, n, key):
    """compare_transports.sh's file of one collective, rank count and transport: allreduce_n2_shm.txt."""
    return os.path.join(run_dir, f"{op.replace('_', '')}_n{n}_{key}.txt")


# ~~~ reading ~~~

def read_bench(path):
    """size -> (raw time us, raw busbw, differentiable-forward busbw or None, ovh % or None); a file with
    several rounds (compare_transports.sh -r) gives each field's median over them."""
    seen = {}
    if not os.path.exists(path):
        return {}
    for line in open(path):
        if line.startswith("#") or "|" not in line:
            continue
        parts = line.split("|")
        size = int(parts[0].split()[0])
        raw = parts[1].split()
        fwd = parts[2].split() if len(parts) > 2 else []
        ovh = parts[-1].strip() if len(parts) > 3 else ""
        seen.setdefault(size, []).append((float(raw[0]), float(raw[2]), float(fwd[2]) if len(fwd) > 2 else None,
                                          float(ovh) if re.fullmatch(r"[+-]?[0-9.]+", ovh) else None))
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None
    return {size: tuple(median(field) for field in zip(*rounds)) for size, rounds in seen.items()}


# The cross-core round trips a VM's host switches between (bench/core_latency.c):
# below 80 ns, 80-250 ns and above, named by their typical value here.
PLACEMENTS = ((80, "~40 ns"), (250, "~125 ns"), (float("inf"), "~430 ns"))


def placement_class(ns):
    return next(name for limit, name in PLACEMENTS if ns < limit)


def read_programs(path):
    """One dict per program of a compare_transports.sh file, in order (round 1 first): 'rows' {size: raw time us},
    'before' and 'after' the cross-core round trips around it in ns ('# placement before/after: ... N ns'), 'steal'
    the ms the host took from the vCPUs while it ran ('# host: steal N ms'); the last three None where missing."""
    programs = []
    if not os.path.exists(path):
        return programs
    for line in open(path):
        placed = re.match(r"# placement (before|after):.* (\d+) ns", line)
        stolen = re.match(r"# host: steal (-?\d+) ms", line)
        if placed and placed.group(1) == "before":
            programs.append({"rows": {}, "before": int(placed.group(2)), "after": None, "steal": None})
        elif placed and programs:
            programs[-1]["after"] = int(placed.group(2))
        elif stolen and programs:
            programs[-1]["steal"] = int(stolen.group(1))
        elif not line.startswith("#") and "|" in line:
            if not programs or programs[-1]["after"] is not None:  # a file without placements
                programs.append({"rows": {}, "before": None, "after": None, "steal": None})
            parts = line.split("|")
            programs[-1]["rows"][int(parts[0].split()[0])] = float(parts[1].split()[0])
    return programs


def read_placed(path):
    """placement class -> [one program's {size: raw time us}] for the programs of a file whose round trip before
    and after them fell in the same class (read_programs); programs that met two classes, or carry no placement,
    are left out."""
    placed = {}
    for p in read_programs(path):
        if p["before"] is None or p["after"] is None or not p["rows"]:
            continue
        if placement_class(p["before"]) == placement_class(p["after"]):
            placed.setdefault(placement_class(p["before"]), []).append(p["rows"])
    return placed


def read_floor(path, n):
    """size -> (floor time us, floor busbw, None, None) from bench/copy_floor.c's rounds: (5n-2)/(2n) times the
    median memcpy, what a transport staging through shared memory must copy (compare_transports.sh)."""
    seen = {}
    if not os.path.exists(path):
        return {}
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        size, t = line.split()[:2]
        seen.setdefault(int(size), []).append(float(t))
    rows = {}
    for size, times in seen.items():
        t = (5 * n - 2) / (2 * n) * statistics.median(times)
        rows[size] = (t, size / t / 1e3 * 2 * (n - 1) / n, None, None)
    return rows


def newest_session(results):
    """The folders of the highest runN under RESULTS/transports, sorted by name.

    Only sessions that measured all_reduce count: the plot and the tables are
    drawn around it, and a run of one other collective must not hide them."""
    runs = {}
    for d in glob.glob(os.path.join(results, "transports", "run*")):
        m = re.match(r"run(\d+)", os.path.basename(d))
        if m and os.path.isdir(d):
            runs.setdefault(int(m.group(1)), []).append(d)
    runs = {k: ds for k, ds in runs.items() if any(glob.glob(results_file(d, "all_reduce", "*", "shm")) for d in ds)}
    if not runs:
        raise SystemExit(f"plot_results: no {results}/transports/run*/ folders with all_reduce results")
    return sorted(runs[max(runs)])


def machine(run_dir):
    path = os.path.join(run_dir, "machine.txt")
    return open(path).readline().lstrip("# ").strip() if os.path.exists(path) else "?"


def session_machine(runs):
    """'2026-12-01 09:37-09:40 UTC, 2 cores (CPU)' from the runs' machine.txt."""
    lines = sorted(machine(d) for d in runs)
    m = [re.match(r"(\S+) (\S+) UTC, (.*)", x) for x in lines]
    if not all(m) or len({x.group(3) for x in m}) != 1:
        return "; ".join(lines)
    first, last = m[0], m[-1]
    span = first.group(2) if first.group(2) == last.group(2) else f"{first.group(2)}-{last.group(2)}"
    day = first.group(1) if first.group(1) == last.group(1) else f"{first.group(1)} to {last.group(1)}"
    return f"{day} {span} UTC, {first.group(3)}"


def session_data(runs, n, op="all_reduce"):
    """{series label: [per-run {size: row}]} for one collective and rank count; the copy floor is all_reduce's."""
    data = {}
    for label, key in TRANSPORTS:
        data[label] = [r for r in (read_bench(results_file(d, op, n, key)) for d in runs) if r]
    if op == "all_reduce":
        data["copy floor"] = [r for r in (read_floor(os.path.join(d, f"copy_floor_n{n}.txt"), n) for d in runs) if r]
    return data


def session_ranks(runs, op="all_reduce"):
    """The rank counts the runs measured `op` at."""
    found = set()
    for d in runs:
        for path in glob.glob(results_file(d, op, "*", "*")):
            m = re.search(r"_n(\d+)_", os.path.basename(path))
            if m:
                found.add(int(m.group(1)))
    return sorted(found)


def newest(pattern):
    found = sorted(glob.glob(pattern))
    return found[-1] if found else None


# ~~~ a minimal SVG line plot ~~~

def human(b):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale:
            return f"{b // scale}{unit}"
    return str(b)


def log_ticks(lo, hi):
    return [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]


def panel(o, x, y, w, h, title, series, xs, ylo, yhi):
    """Log-log panel at (x, y): series = [(label, [(size, mid, lo, hi)], dashed)]."""
    lx0, lx1 = math.log2(xs[0]), math.log2(xs[-1])
    ly0, ly1 = math.log10(ylo), math.log10(yhi)
    X = lambda s: x + (math.log2(s) - lx0) / (lx1 - lx0) * w
    Y = lambda v: y + h - (math.log10(v) - ly0) / (ly1 - ly0) * h
    o.append(f'<text x="{x + w / 2}" y="{y - 8}" text-anchor="middle" font-size="13">{title}</text>')
    for t in log_ticks(ylo, yhi):
        if ylo <= t <= yhi:
            o.append(f'<line x1="{x}" y1="{Y(t):.1f}" x2="{x + w}" y2="{Y(t):.1f}" stroke="#ddd"/>')
            o.append(f'<text x="{x - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    for s in xs:
        o.append(f'<text x="{X(s):.1f}" y="{y + h + 16}" text-anchor="middle">{human(s)}</text>')
    o.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="black"/>')
    for label, pts, dashed in series:
        if not pts:
            continue
        c = COLORS.get(label, OP_COLOR)
        band = [(X(s), Y(hi)) for s, _, _, hi in pts] + [(X(s), Y(lo)) for s, _, lo, _ in reversed(pts)]
        o.append('<polygon points="' + " ".join(f"{a:.1f},{b:.1f}" for a, b in band) +
                 f'" fill="{c}" fill-opacity="0.15" stroke="none"/>')
        line = " ".join(f"{X(s):.1f},{Y(m):.1f}" for s, m, _, _ in pts)
        dash = ' stroke-dasharray="6,4"' if dashed else ""
        o.append(f'<polyline points="{line}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        for s, m, _, _ in pts:
            o.append(f'<circle cx="{X(s):.1f}" cy="{Y(m):.1f}" r="2.5" fill="{c}"/>')


def legend(o, x, y, entries):
    for i, (label, dashed) in enumerate(entries):
        c = COLORS.get(label, OP_COLOR)
        dash = ' stroke-dasharray="6,4"' if dashed else ""
        o.append(f'<line x1="{x}" y1="{y + 18 * i}" x2="{x + 28}" y2="{y + 18 * i}" stroke="{c}" stroke-width="2"{dash}/>')
        o.append(f'<text x="{x + 34}" y="{y + 18 * i + 4}">{label}</text>')


def svg_open(w, h):
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'font-family="sans-serif" font-size="11">', f'<rect width="{w}" height="{h}" fill="white"/>']


def write(path, o):
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")
    print(f"plot_results: wrote {path}")


# ~~~ the plots ~~~

def median_band(per_run, field):
    """[(size, median, min, max)] of one field over the runs, at the sizes every run has."""
    sizes = sorted(set.intersection(*(set(r) for r in per_run))) if per_run else []
    if not all(r[s][field] is not None for r in per_run for s in sizes):
        return []
    return [(s, statistics.median(r[s][field] for r in per_run), min(r[s][field] for r in per_run),
             max(r[s][field] for r in per_run)) for s in sizes]


def busbw_plot(runs, path, op="all_reduce"):
    """One panel per rank count: each transport's bus bandwidth (and the copy floor, and the differentiable op
    over shm where the runs timed it) against size."""
    ranks = session_ranks(runs, op)
    W, PW, PH, L, T = 480 * max(len(ranks), 1) + 40, 400, 300, 60, 60
    o = svg_open(max(W, 760), PH + T + 155)
    names = ", ".join(os.path.basename(d) for d in runs)
    o.append(f'<text x="{L}" y="20" font-size="14">{op} float32: bus bandwidth (GB/s, log) against '
             f'message size (bytes, log)</text>')
    o.append(f'<text x="{L}" y="38">line: median over the runs {names}; band: their min-max</text>')
    op_label = f"ops::{op} on shm"
    with_op = False
    m = re.search(r"(\d+) cores", session_machine(runs))
    measured_cores = int(m.group(1)) if m else None
    for i, n in enumerate(ranks):
        data = session_data(runs, n, op)
        series = [(label, median_band(per_run, 1), False) for label, per_run in data.items()]
        op_line = median_band(data["shm"], 2)
        if op_line:
            series.append((op_label, op_line, True))
            with_op = True
        values = [v for _, pts, _ in series for p in pts for v in p[1:]]
        xs = sorted({p[0] for _, pts, _ in series for p in pts})
        if not xs:
            continue
        ylo = 10 ** math.floor(math.log10(min(values)))
        yhi = 10 ** math.ceil(math.log10(max(values)))
        cores = f" on {measured_cores} cores" if measured_cores and n > measured_cores else ""
        panel(o, L + i * 480, T + 20, PW, PH, f"{n} ranks{cores}", series, xs, ylo, yhi)
    entries = [("shm", False), ("Gloo", False), ("OpenMPI", False)]
    legend(o, L, T + PH + 80, entries + ([("copy floor", False)] if op == "all_reduce" else []))
    if with_op:
        legend(o, L + 200, T + PH + 80, [(op_label, True)])
        o.append(f'<text x="{L + 200}" y="{T + PH + 102}">(commgrad-bench\'s differentiable forward over the shm '
                 'transport)</text>')
    else:
        o.append(f'<text x="{L + 200}" y="{T + PH + 84}">each transport\'s call timed alone (commgrad-bench '
                 '--raw-only)</text>')
    o.append(f'<text x="{L + 200}" y="{T + PH + 120}">measured {session_machine(runs)}</text>')
    o.append(f'<text x="{L}" y="{T + PH + 56}">message size (bytes)</text>')
    write(path, o)


def tp_rows(path):
    """[(label, [per-rep ratio], ratio of the medians)] from a tp_mlp csv (p50 ms per rep)."""
    by = {}
    for r in csv.DictReader(open(path)):
        by.setdefault(r["configuration"], []).append((float(r["commgrad_ms"]), float(r["python_ms"])))
    return [(f"TP MLP, {k}", [p / c for c, p in v],
             statistics.median(p for _, p in v) / statistics.median(c for c, _ in v)) for k, v in by.items()]


def gpt_rows(path):
    """[(label, [per-round ratio], ratio of the medians)] from bench/compare_gpt.sh's summary.md."""
    rows, n = [], None
    for line in open(path):
        m = re.match(r"(\d+) ranks, ", line)
        if m:
            n = int(m.group(1))
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6 or not cells[0].startswith("TP="):
            continue
        layout = cells[0].replace(" x ", " ").replace("TP=1 ", "").replace(" PP=1", "").replace(" DP=1", "")
        layout = layout.replace("PP=1 ", "")
        sched = f", {cells[1]}" if cells[1] != "-" else ""
        sched += f" v={cells[2]}" if cells[2] not in ("1", "-") else ""
        m = re.match(r"\*\*([0-9.]+)\*\* \(([^)]*)\)", cells[5])
        rounds = [float(v) for v in m.group(2).split(",")]
        rows.append((f"GPT {layout}{sched}" + (f" ({n} ranks)" if n and n != 2 else ""), rounds, float(m.group(1))))
    return rows


def vs_python_plot(results, out):
    tp = newest(os.path.join(results, "tp_mlp", "*.csv"))
    gpt = newest(os.path.join(results, "gpt", "*", "summary.md"))
    rows = (tp_rows(tp) if tp else []) + (gpt_rows(gpt) if gpt else [])
    if not rows:
        print("plot_results: no tp_mlp or gpt results; vs_python.svg not drawn")
        return
    L, T, PW, RH = 250, 60, 420, 24
    H = T + RH * len(rows) + 50
    o = svg_open(L + PW + 40, H)
    o.append(f'<text x="10" y="20" font-size="14">commgrad throughput / Python PyTorch throughput (log)</text>')
    srcs = ", ".join(os.path.relpath(p, results) for p in (tp, gpt) if p)
    o.append(f'<text x="10" y="38">dots: each round; bar: ratio of the medians; from {srcs}</text>')
    values = [v for _, r, m in rows for v in r + [m]]
    lo, hi = min(0.5, min(values) * 0.9), max(2.0, max(values) * 1.1)
    X = lambda v: L + (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)) * PW
    ticks = [t for t in (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4) if lo <= t <= hi]
    for t in ticks:
        o.append(f'<line x1="{X(t):.1f}" y1="{T}" x2="{X(t):.1f}" y2="{T + RH * len(rows)}" '
                 f'stroke="{"black" if t == 1 else "#ddd"}"/>')
        o.append(f'<text x="{X(t):.1f}" y="{T + RH * len(rows) + 16}" text-anchor="middle">{t:g}x</text>')
    o.append(f'<text x="{X(1) + 4:.1f}" y="{T - 6}">Python = 1</text>')
    for i, (label, rounds, mid) in enumerate(rows):
        y = T + RH * i + RH / 2
        c = "#1f77b4" if label.startswith("GPT") else "#ff7f0e"
        o.append(f'<text x="{L - 8}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        o.append(f'<line x1="{X(mid):.1f}" y1="{y - 8:.1f}" x2="{X(mid):.1f}" y2="{y + 8:.1f}" '
                 f'stroke="{c}" stroke-width="4"/>')
        for v in rounds:
            o.append(f'<circle cx="{X(v):.1f}" cy="{y:.1f}" r="3.5" fill="{c}" fill-opacity="0.5"/>')
    o.append(f'<text x="10" y="{H - 12}">right of the black line: commgrad faster</text>')
    write(os.path.join(out, "vs_python.svg"), o)


# ~~~ the collectives tables ~~~

def ratio_range(values, suffix="x"):
    lo, hi = min(values), max(values)
    f = lambda v: f"{v:.0f}" if v >= 10 else f"{v:.1f}"
    return f"{f(lo)}{suffix}" if f(lo) == f(hi) else f"{f(lo)}-{f(hi)}{suffix}"


def tables(runs):
    print(f"Runs: {', '.join(os.path.basename(d) for d in runs)} ({session_machine(runs)})\n")
    print("| size | 2 ranks: shm busbw GB/s | shm vs Gloo | shm vs OpenMPI | shm / copy floor "
          "| 4 ranks: shm busbw GB/s | shm vs Gloo | shm vs OpenMPI | shm / copy floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    d2, d4 = session_data(runs, 2), session_data(runs, 4)
    sizes = sorted(set.intersection(*(set(r) for r in d2["shm"] + d4["shm"])))
    for s in sizes:
        cells = [size_name(s)]
        for d in (d2, d4):
            shm = d["shm"]
            cells.append(ratio_range([r[s][1] for r in shm], ""))
            for peer in ("Gloo", "OpenMPI"):
                pairs = [(a[s][0], b[s][0]) for a, b in zip(shm, d[peer]) if s in a and s in b]
                cells.append(ratio_range([p / a for a, p in pairs]) if pairs else "-")
            pairs = [(a[s][0], f[s][0]) for a, f in zip(shm, d["copy floor"]) if s in a and s in f]
            cells.append(ratio_range([a / f for a, f in pairs]) if pairs else "-")
        print("| " + " | ".join(cells) + " |")
    other_collectives_tables(runs)
    if not any(r[s][3] is not None for d in (d2, d4) for peer in ("shm", "Gloo") for r in d[peer] for s in r):
        print("\n(No ovh column: these runs timed each transport's call alone, commgrad-bench --raw-only.)")
        return
    print("\nops::all_reduce (differentiable forward) over the raw call of its transport, % (commgrad-bench's ovh):\n")
    print("| size | shm, 2 ranks | Gloo, 2 ranks | shm, 4 ranks | Gloo, 4 ranks |")
    print("|---|---:|---:|---:|---:|")
    for s in sizes:
        cells = [size_name(s)]
        for d in (d2, d4):
            for peer in ("shm", "Gloo"):
                v = [r[s][3] for r in d[peer] if s in r and r[s][3] is not None]
                cells.append(f"{min(v):+.0f} to {max(v):+.0f}" if v else "-")
        print("| " + " | ".join(cells) + " |")


def other_collectives_tables(runs):
    """shm's speed-up over OpenMPI and over Gloo for the collectives other than all_reduce, where the runs
    measured them (compare_transports.sh --op): one column per collective and rank count."""
    columns = [(op, n) for op in OPS[1:] for n in session_ranks(runs, op)]
    if not columns:
        return
    data = {(op, n): session_data(runs, n, op) for op, n in columns}
    sizes = sorted(set.intersection(*(set(r) for d in data.values() for r in d["shm"])))
    for peer in ("OpenMPI", "Gloo"):
        print(f"\nshm vs {peer} (time ratio, higher: shm faster):\n")
        print("| size | " + " | ".join(f"{op}, {n} ranks" for op, n in columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for s in sizes:
            cells = [size_name(s)]
            for column in columns:
                d = data[column]
                pairs = [(a[s][0], b[s][0]) for a, b in zip(d["shm"], d[peer]) if s in a and s in b]
                cells.append(ratio_range([p / a for a, p in pairs]) if pairs else "-")
            print("| " + " | ".join(cells) + " |")


# ~~~ one compare_transports.sh run ~~~

def size_name(b):
    return human(b).replace("K", " KiB").replace("M", " MiB").replace("G", " GiB")


def speedup(ratio):
    """'1.52x faster', or '1.32x slower' when the ratio (their time / shm's) is below 1."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def run_table(run_dir, op, n):
    """The markdown table of one collective at n ranks in one run: each transport's median time and busbw, then
    shm's speed-up over the others and its time over the copy floor."""
    data = {label: rows[0] for label, rows in session_data([run_dir], n, op).items() if rows}
    if "shm" not in data:
        return []
    present = [label for label in ("Gloo", "shm", "OpenMPI", "copy floor") if label in data]
    ratios = [f"shm vs {p}" for p in ("Gloo", "OpenMPI") if p in data] + (["shm / floor"] if "copy floor" in data else [])
    md = [f"{op} float32, {n} ranks: time per call (us; the median over the rounds of each round's median) "
          "and bus bandwidth (GB/s)", "",
          "| size | " + " | ".join(f"{label} time | {label} busbw" for label in present) +
          "".join(f" | {r}" for r in ratios) + " |",
          "|" + "---|" * (1 + 2 * len(present) + len(ratios))]
    for s in sorted(data["shm"]):
        cells = [size_name(s)]
        for label in present:
            t, b = data[label].get(s, (float("nan"), float("nan")))[:2]
            cells += [f"{t:.1f}", f"{b:.3f}"]
        shm_t = data["shm"][s][0]
        for label in ("Gloo", "OpenMPI"):
            if label in data:
                other = data[label].get(s)
                cells.append(speedup(other[0] / shm_t) if other and shm_t > 0 else "")
        if "copy floor" in data:
            f = data["copy floor"].get(s)
            cells.append(f"{shm_t / f[0]:.2f}x" if f and f[0] > 0 else "")
        md.append("| " + " | ".join(cells) + " |")
    return md + [""]


def placement_table(run_dir, op, n):
    """shm against OpenMPI within each placement class both met (read_placed): per class, each transport's median
    over its programs of their per-size medians, and the ratio; empty when the outputs carry no placement."""
    shm = read_placed(results_file(run_dir, op, n, "shm"))
    mpi = read_placed(results_file(run_dir, op, n, "mpi"))
    classes = [name for _, name in PLACEMENTS if name in shm and name in mpi]
    if not classes:
        return []
    md = [f"{op} float32, {n} ranks, within one placement (cross-core round trip before and after the program in "
          "the same class): time per call (us; the median over the programs), programs counted in the header", "",
          "| size | " + " | ".join(f"{c}: shm ({len(shm[c])}) | OpenMPI ({len(mpi[c])}) | shm vs OpenMPI"
                                    for c in classes) + " |",
          "|" + "---|" * (1 + 3 * len(classes))]
    for s in sorted(set().union(*(r for c in classes for r in shm[c]))):
        cells = [size_name(s)]
        for c in classes:
            a = [r[s] for r in shm[c] if s in r]
            b = [r[s] for r in mpi[c] if s in r]
            if not a or not b:
                cells += ["", "", ""]
                continue
            ta, tb = statistics.median(a), statistics.median(b)
            cells += [f"{ta:.1f}", f"{tb:.1f}", speedup(tb / ta) if ta > 0 else ""]
        md.append("| " + " | ".join(cells) + " |")
    return md + [""]


def trailing_rounds(run_dir, op, n):
    """The rounds in which shm took longer than OpenMPI at some size (round r of one against round r of the
    other: the rounds alternate the transports), each with both programs' placements and the host's steal."""
    shm = read_programs(results_file(run_dir, op, n, "shm"))
    mpi = read_programs(results_file(run_dir, op, n, "mpi"))
    if not shm or not mpi:
        return []

    def context(p):
        trip = "" if p["before"] is None else f"{p['before']}/{p['after']} ns"
        stolen = "" if p["steal"] is None else f", steal {p['steal']} ms"
        return trip + stolen

    lines = []
    for r, (a, b) in enumerate(zip(shm, mpi), 1):
        behind = [f"{size_name(s)} {a['rows'][s]:.1f}/{b['rows'][s]:.1f}" for s in sorted(a["rows"])
                  if s in b["rows"] and a["rows"][s] > b["rows"][s]]
        if behind:
            lines.append(f"- round {r}: {', '.join(behind)} (shm {context(a)}; OpenMPI {context(b)})")
    head = f"{op} float32, {n} ranks, round by round: "
    if not lines:
        return [head + f"shm ahead of OpenMPI at every size in each of the {min(len(shm), len(mpi))} rounds", ""]
    return [head + "where shm trailed OpenMPI (shm/OpenMPI us; the cross-core round trip before/after "
            "each program, and the time the host took from the vCPUs during it)", ""] + lines + [""]


def run_summary(run_dir):
    """DIR/summary.md (every collective and rank count of one run) and DIR/OP_busbw.svg; prints the summary."""
    md = [machine(run_dir)]
    for line in open(os.path.join(run_dir, "machine.txt")).readlines()[1:]:
        md[0] += "; " + line.lstrip("# ").strip()
    md.append("")
    for op in OPS:
        ranks = session_ranks([run_dir], op)
        if not ranks:
            continue
        for n in ranks:
            md += run_table(run_dir, op, n)
            md += placement_table(run_dir, op, n)
            md += trailing_rounds(run_dir, op, n)
        name = f"{op.replace('_', '')}_busbw.svg"
        busbw_plot([run_dir], os.path.join(run_dir, name), op)
        md += [f"![{op} bus bandwidth]({name})", ""]
    with open(os.path.join(run_dir, "summary.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=os.path.normpath(os.path.join(here, "results")))
    p.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "docs", "images")))
    p.add_argument("--tables", action="store_true", help="print the collectives tables instead of drawing")
    p.add_argument("--run", metavar="DIR", help="summarise one compare_transports.sh run folder instead")
    a = p.parse_args()
    if a.run:
        run_summary(a.run)
        return
    runs = newest_session(a.results)
    if a.tables:
        tables(runs)
        return
    os.makedirs(a.out, exist_ok=True)
    busbw_plot(runs, os.path.join(a.out, "busbw_allreduce.svg"))
    vs_python_plot(a.results, a.out)


if __name__ == "__main__":
    main()
