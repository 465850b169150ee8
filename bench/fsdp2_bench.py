#!/usr/bin/env python3
"""The FSDP step of zero_bench.cpp in Python PyTorch: FSDP2 (torch.distributed.fsdp.fully_shard).

The model and step of zero_bench's FSDP variants: `--layers` x (Linear(width,
width) + ReLU), fully_shard on every Linear and then on the root (FSDP2's
bottom-up order, one unit per Linear), Adam at 1e-4 (foreach=False: the
per-tensor update LibTorch's Adam computes; it is also what torch picks on
the CPU), loss mean((out - y)^2) over a batch of `--batch` random rows per
rank, float32 on the CPU, one intra-op thread per rank. Two variants, as in
zero_bench: reshard_after_forward True (FSDP2's default) and False; every
round takes one step of each, a barrier before each step, and rank 0 times
the step (forward, backward, optimizer step, zero_grad), as zero_bench does.

    torchrun --nproc-per-node 2 bench/fsdp2_bench.py [--backend commgrad|gloo] [--layers 8] [--width 512]
                                                     [--batch 32] [--steps 15] [--times FILE]
    python bench/fsdp2_bench.py --summarize DIR     # the tables of bench/fsdp_compare.sh

--times FILE: rank 0 writes every measured step's time as CSV rows
(implementation,backend,ranks,variant,step,ms), the columns zero_bench
--times writes. The "commgrad" backend is commgrad's shm transport, and is
written as "shm" there, the name zero_bench gives it.

--summarize DIR reads the CSV files bench/fsdp_compare.sh left in DIR
(cpp_<transport>_n<N>_r<round>.csv, py_..._r<round>.csv) and its load
samples (loadavg.txt), and prints the markdown tables: C++ fully_shard
against FSDP2 per transport and world size (every measured step of every
round pooled: p50, p10, p90; the ratio of the pooled medians, and the
per-round ratios), and C++ FSDP against ZeRO-2 and DDP of the same runs.
"""

import argparse
import csv
import glob
import os
import re
import statistics
import sys
import time
from collections import defaultdict

VARIANTS = (("FSDP + Adam, reshard after forward", True), ("FSDP + Adam, no reshard", False))
CSV_HEADER = ["implementation", "backend", "ranks", "variant", "step", "ms"]


def percentile(values, q):
    """The q-quantile (0..1) of `values`, nearest rank (zero_bench's rule)."""
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def make_variant(args, reshard, mesh):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())])
    for layer in net[::2]:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(net, mesh=mesh, reshard_after_forward=reshard)
    return net, torch.optim.Adam(net.parameters(), lr=1e-4, foreach=False)


def step(net, opt, x, y):
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = (net(x).float() - y).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return (time.perf_counter() - start) * 1e3


def bench(args):
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if args.backend == "commgrad":
        import commgrad  # noqa: F401  registers the backend
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(1 + rank)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    variants = [(name, *make_variant(args, reshard, mesh), []) for name, reshard in VARIANTS]
    warmup = 3  # zero_bench's
    for r in range(warmup + args.steps):
        for name, net, opt, times in variants:
            t = step(net, opt, x, y)
            if r >= warmup:
                times.append(t)
    if rank == 0:
        transport = "shm" if args.backend == "commgrad" else args.backend
        params = sum(p.numel() for p in variants[0][1].parameters())
        print(f"fsdp2_bench: {n} ranks ({args.backend}), torch {torch.__version__}, {args.layers} x "
              f"Linear({args.width}, {args.width}): Psi = {params} parameters, batch {args.batch} per rank, "
              f"{args.steps} steps after {warmup} warm-up\n")
        print("Step time (rank 0), ms:\n| variant | p50 | p10 | p90 |\n|---|---:|---:|---:|")
        for name, _, _, times in variants:
            print(f"| {name} | {percentile(times, 0.5):.2f} | {percentile(times, 0.1):.2f} | "
                  f"{percentile(times, 0.9):.2f} |")
        if args.times:
            with open(args.times, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(CSV_HEADER)
                for name, _, _, times in variants:
                    for k, t in enumerate(times):
                        w.writerow(["fsdp2", transport, n, name, k + 1, t])
    dist.destroy_process_group()


# --summarize

def read_runs(out_dir):
    """{(implementation, transport, ranks, variant): {round: [ms...]}} of DIR's CSV files."""
    runs = defaultdict(lambda: defaultdict(list))
    for path in sorted(glob.glob(os.path.join(out_dir, "*_n*_r*.csv"))):
        rnd = int(re.search(r"_r(\d+)\.csv$", path).group(1))
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                key = (row["implementation"], row["backend"], int(row["ranks"]), row["variant"])
                runs[key][rnd].append(float(row["ms"]))
    return runs


def pooled(rounds):
    return [t for times in rounds.values() for t in times]


def load_line(out_dir):
    path = os.path.join(out_dir, "loadavg.txt")
    if not os.path.exists(path):
        return "load average: not sampled"
    with open(path) as f:
        ones = [float(line.split()[1]) for line in f if len(line.split()) >= 2]
    if not ones:
        return "load average: not sampled"
    return (f"1-minute load average during the run (sampled every 5 s, {len(ones)} samples): "
            f"{min(ones):.2f}-{max(ones):.2f}, mean {statistics.mean(ones):.2f}")


def header_line(out_dir):
    path = next(iter(sorted(glob.glob(os.path.join(out_dir, "cpp_*_r1.txt")))), None)
    if path is None:
        return ""
    with open(path) as f:
        for line in f:
            m = re.search(r"zero_bench: \d+ ranks \(\w+\), (.*)", line)
            if m:
                return "Model and step (zero_bench's): " + m.group(1).strip()
    return ""


def fmt_ratios(ratios):
    return ", ".join(f"{r:.2f}" for r in ratios)


def summarize(out_dir):
    runs = read_runs(out_dir)
    if not runs:
        sys.exit(f"summarize: no *_n*_r*.csv in {out_dir}")
    configs = sorted({(t, n) for (_, t, n, _) in runs}, key=lambda c: (c[1], c[0] != "shm", c[0]))
    nrounds = max(max(r) for r in runs.values())
    print("# C++ `fsdp::fully_shard` against Python FSDP2\n")
    print(f"{header_line(out_dir)}. {nrounds} rounds, C++ and Python in alternating order. "
          f"{load_line(out_dir)}.\n")
    print("Step time in ms, rank 0, every measured step of every round pooled; ratio = C++ p50 / FSDP2 p50 "
          "(below 1: C++ faster), the per-round ratios in brackets:\n")
    print("| ranks | transport | variant | C++ p50 | p10 | p90 | FSDP2 p50 | p10 | p90 | C++ / FSDP2 | per round |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for transport, n in configs:
        for name, _ in VARIANTS:
            cpp, py = runs.get(("commgrad", transport, n, name)), runs.get(("fsdp2", transport, n, name))
            if not cpp or not py:
                continue
            a, b = pooled(cpp), pooled(py)
            per_round = [percentile(cpp[r], 0.5) / percentile(py[r], 0.5) for r in sorted(cpp) if r in py]
            print(f"| {n} | {transport} | {name.removeprefix('FSDP + Adam, ')} | {percentile(a, 0.5):.1f} | "
                  f"{percentile(a, 0.1):.1f} | {percentile(a, 0.9):.1f} | {percentile(b, 0.5):.1f} | "
                  f"{percentile(b, 0.1):.1f} | {percentile(b, 0.9):.1f} | "
                  f"**{percentile(a, 0.5) / percentile(b, 0.5):.2f}** | {fmt_ratios(per_round)} |")
    print("\nC++ FSDP against ZeRO-2 and DDP in the same zero_bench runs (p50 ms, pooled; ratios of the p50s):\n")
    print("| ranks | transport | DDP | ZeRO-2 | FSDP, reshard | FSDP, no reshard | ZeRO-2 / DDP | "
          "FSDP reshard / ZeRO-2 | FSDP no reshard / ZeRO-2 |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    names = ("DDP + Adam", "ZeRO-2 + Adam", VARIANTS[0][0], VARIANTS[1][0])
    for transport, n in configs:
        rows = [runs.get(("commgrad", transport, n, name)) for name in names]
        if not all(rows):
            continue
        ddp, zero2, reshard, keep = (percentile(pooled(r), 0.5) for r in rows)
        print(f"| {n} | {transport} | {ddp:.1f} | {zero2:.1f} | {reshard:.1f} | {keep:.1f} | {zero2 / ddp:.2f} | "
              f"{reshard / zero2:.2f} | {keep / zero2:.2f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summarize", metavar="DIR", help="print the tables of bench/fsdp_compare.sh's DIR and stop")
    p.add_argument("--backend", default="commgrad", choices=["commgrad", "gloo"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="rows per rank")
    p.add_argument("--steps", type=int, default=15, help="measured steps (after 3 warm-up steps)")
    p.add_argument("--bucket-cap-mb", type=float, help="ignored (zero_bench's DDP and ZeRO option)")
    p.add_argument("--times", metavar="FILE", help="rank 0 writes every measured step's time (CSV)")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        bench(args)


if __name__ == "__main__":
    main()
