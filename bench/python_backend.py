"""torch.distributed's all_reduce, DDP steps (an MLP and a small transformer) and an FSDP2 step on
"commgrad" and on "gloo", side by side in one job (nccl-tests-style tables on rank 0), and a plot.

    torchrun --nproc-per-node N bench/python_backend.py [--min-time 0.3] [--max-bytes 64M] [--out DIR]
    python bench/python_backend.py --plot DIR      # only redraw DIR's plot

The default group is commgrad's; a second group over the same ranks is
Gloo's, so both run on the same processes. all_reduce: for each size the two
backends run one after the other; time is the mean per call over at least
--min-time seconds after a warm-up, the slowest rank's (nccl-tests reports
the same), algbw = bytes / time, busbw = algbw * 2 (n - 1) / n; #wrong counts
elements that differ from the closed form (every rank contributes rank + 1).
Training steps: --rounds rounds, each timing both backends (in alternating
order) for --min-time seconds, so that a load that comes and goes on a
shared machine falls on both; reported as each backend's median step time
and the median (min-max) over the rounds of their ratio.

With --out DIR, rank 0 writes the all_reduce results to
DIR/python_backend_<N>ranks.json and draws every world size found there into
DIR/python_backend.svg: latency against size (log-log) and the speedup over
Gloo. The plot needs matplotlib (bench/requirements.txt); without it the
tables are printed all the same.
"""

import argparse
import glob
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def root(group):
    return dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0


def timed(fn, min_time, group, warmup=3):
    """Mean seconds per call of `fn`, the slowest rank's. Rank 0 picks the
    number of calls from a short calibration, so that the timed loop itself
    holds nothing but `fn`."""
    for _ in range(warmup):
        fn()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    estimate = (time.perf_counter() - t0) / 3
    iters = torch.tensor([max(5, int(min_time / max(estimate, 1e-7)))])
    dist.broadcast(iters, src=root(group), group=group)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(int(iters.item())):
        fn()
    mean = torch.tensor([(time.perf_counter() - t0) / int(iters.item())])
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)
    return mean.item()


def all_reduce_table(groups, min_time, max_bytes):
    n, rank = dist.get_world_size(), dist.get_rank()
    names = list(groups)
    if rank == 0:
        head = f"{'size':>10} {'count':>10} {'type':>6}"
        for name in names:
            head += f" | {name + ' time(us)':>17} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        head += f" | {'speedup':>7}"
        print(f"# all_reduce SUM float32, {n} ranks (GB/s); speedup = {names[1]} time / {names[0]} time\n"
              f"{head}\n{'-' * len(head)}", flush=True)
    rows = []
    size = 4096
    while size <= max_bytes:
        count = size // 4
        row = f"{size:>10} {count:>10} {'float':>6}"
        times = {}
        for name, group in groups.items():
            x = torch.full((count,), float(rank + 1))
            t = timed(lambda: dist.all_reduce(x, group=group), min_time, group)
            y = torch.full((count,), float(rank + 1))
            dist.all_reduce(y, group=group)
            wrong = torch.tensor([(y != n * (n + 1) / 2).sum().item()])
            dist.all_reduce(wrong, group=group)
            algbw = size / t / 1e9
            row += f" | {t * 1e6:>17.1f} {algbw:>7.2f} {algbw * 2 * (n - 1) / n:>7.2f} {int(wrong.item()):>6}"
            times[name] = t
        row += f" | {times[names[1]] / times[names[0]]:>6.1f}x"
        rows.append({"bytes": size, "time_s": times})
        if rank == 0:
            print(row, flush=True)
        size *= 4
    return rows


def side_by_side(title, make_step, groups, min_time, rounds):
    """Step time of `make_step(group)()` on each backend over `rounds`
    alternating rounds; prints medians and the ratio of the second backend's
    time to the first's (median, min-max over the rounds)."""
    names = list(groups)
    steps = {name: make_step(group) for name, group in groups.items()}
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed(steps[name], min_time, groups[name], warmup=3 if r == 0 else 1))
    if dist.get_rank() == 0:
        ratios = [b / a for a, b in zip(times[names[0]], times[names[1]])]
        print(f"\n# {title}, {dist.get_world_size()} ranks, {rounds} rounds")
        for name in names:
            print(f"{name:>10}: {statistics.median(times[name]) * 1e3:8.1f} ms/step (median)")
        print(f"{'speedup':>10}: {statistics.median(ratios):8.2f}x ({min(ratios):.2f}-{max(ratios):.2f}; "
              f"{names[1]} time / {names[0]} time)", flush=True)


def mlp(hidden, layers):
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.GELU())])


def sgd_step(net, x, y):
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return step


def ddp_mlp(args, groups):
    from torch.nn.parallel import DistributedDataParallel as DDP
    h, n = args.ddp_hidden, args.ddp_layers

    def make(group):
        x, y = torch.randn(args.ddp_batch, h), torch.randn(args.ddp_batch, h)
        return sgd_step(DDP(mlp(h, n), process_group=group), x, y)
    params = sum(p.numel() for p in mlp(h, n).parameters())
    side_by_side(f"DDP step, MLP {n} x Linear({h}, {h}) ({params / 1e6:.1f} M parameters, "
                 f"{params * 4 / 2**20:.0f} MiB of gradients), batch {args.ddp_batch}",
                 make, groups, args.min_time, args.rounds)


def transformer(d_model, layers):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def ddp_transformer(args, groups):
    from torch.nn.parallel import DistributedDataParallel as DDP
    d, n, seq, batch = args.tf_d_model, args.tf_layers, args.tf_seq, args.tf_batch

    def make(group):
        x, y = torch.randn(batch, seq, d), torch.randn(batch, seq, d)
        return sgd_step(DDP(transformer(d, n), process_group=group), x, y)
    params = sum(p.numel() for p in transformer(d, n).parameters())
    side_by_side(f"DDP step, transformer {n} x TransformerEncoderLayer(d_model {d}, 4 heads, ff {4 * d}) "
                 f"({params / 1e6:.2f} M parameters, {params * 4 / 2**20:.1f} MiB of gradients), "
                 f"batch {batch} x seq {seq}", make, groups, args.min_time, args.rounds)


def fsdp2(args, groups):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def make(group):
        net = mlp(args.ddp_hidden, args.ddp_layers)
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in net[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        x, y = torch.randn(args.ddp_batch, args.ddp_hidden), torch.randn(args.ddp_batch, args.ddp_hidden)
        return sgd_step(net, x, y)
    side_by_side(f"FSDP2 step (fully_shard per Linear), the DDP MLP, batch {args.ddp_batch}",
                 make, groups, args.min_time, args.rounds)


def size_label(b):
    return f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K"


def plot(out_dir):
    """Draws every DIR/python_backend_<N>ranks.json into DIR/python_backend.svg."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "python_backend_*ranks.json"))):
        with open(path) as f:
            run = json.load(f)
        runs[run["ranks"]] = run
    if not runs:
        print(f"plot: no python_backend_<N>ranks.json in {out_dir}")
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed (pip install -r bench/requirements.txt); no plot drawn")
        return
    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9})
    fig, (lat, speed) = plt.subplots(1, 2, figsize=(9, 3.6))
    sizes = sorted({r["bytes"] for run in runs.values() for r in run["all_reduce"]})
    for n, run in sorted(runs.items()):
        rows, (mine, other) = run["all_reduce"], run["backends"]
        for name, style in ((mine, "-o"), (other, "--s")):
            lat.plot([r["bytes"] for r in rows], [r["time_s"][name] * 1e6 for r in rows], style, ms=3,
                     label=f"{name}, {n} ranks")
        speed.plot([r["bytes"] for r in rows], [r["time_s"][other] / r["time_s"][mine] for r in rows], "-o", ms=3,
                   label=f"{n} ranks")
    lat.set(xscale="log", yscale="log", xlabel="message size", ylabel="time per all_reduce (us)",
            title="torch.distributed all_reduce, float32")
    speed.set(xscale="log", yscale="log", xlabel="message size",
              ylabel=f"speedup ({other} time / {mine} time)", title=f"{mine} over {other}")
    speed.axhline(1, color="gray", lw=0.8)
    speed.axhline(50, color="gray", lw=0.8, ls=":", label="goal at 4K: 50x")
    for ax in (lat, speed):
        ax.set_xticks(sizes, [size_label(b) for b in sizes])
        ax.minorticks_off()
        ax.grid(True, which="major", lw=0.3)
        ax.legend(fontsize=7)
    # "...; 2 CPUs, load average 6.2 at the start": one line for the runs.
    host = next(iter(runs.values()))["host"].split(", load average")[0]
    loads = ", ".join(f"{n} ranks {run['host'].split('load average ')[-1].split()[0]}" for n, run in sorted(runs.items()))
    fig.suptitle(f"{host}\nload average at the start: {loads}", fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "python_backend.svg")
    fig.savefig(path, metadata={"Date": None})
    print(f"plot: {path} ({', '.join(f'{n} ranks' for n in sorted(runs))})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per size, round and backend")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of each training step")
    p.add_argument("--ddp-hidden", type=int, default=1024)
    p.add_argument("--ddp-layers", type=int, default=4)
    p.add_argument("--ddp-batch", type=int, default=32)
    p.add_argument("--tf-d-model", type=int, default=128)
    p.add_argument("--tf-layers", type=int, default=4)
    p.add_argument("--tf-seq", type=int, default=64)
    p.add_argument("--tf-batch", type=int, default=8)
    p.add_argument("--only", default="all_reduce,ddp_mlp,ddp_transformer,fsdp2",
                   help="comma-separated parts to run")
    p.add_argument("--out", help="directory for the results (JSON) and the plot")
    p.add_argument("--plot", metavar="DIR", help="only draw DIR's plot from its JSON results")
    args = p.parse_args()
    if args.plot:
        plot(args.plot)
        return
    import commgrad
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("commgrad")
    groups = {"commgrad": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    host = (f"{commgrad.build_info()}; torch {torch.__version__}; commgrad transport: {commgrad.transport()}; "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    if dist.get_rank() == 0:
        print(f"# {host}")
    parts = args.only.split(",")
    if "all_reduce" in parts:
        rows = all_reduce_table(groups, args.min_time, parse_bytes(args.max_bytes))
        if args.out and dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            n = dist.get_world_size()
            with open(os.path.join(args.out, f"python_backend_{n}ranks.json"), "w") as f:
                json.dump({"ranks": n, "host": host, "backends": list(groups), "all_reduce": rows}, f, indent=1)
            plot(args.out)
    for name, fn in (("ddp_mlp", ddp_mlp), ("ddp_transformer", ddp_transformer), ("fsdp2", fsdp2)):
        if name in parts:
            fn(args, groups)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
