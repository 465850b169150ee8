"""torch.distributed's all_reduce, a DDP step and an FSDP2 step on "commgrad" and on "gloo",
side by side in one job (nccl-tests-style table on rank 0).

    torchrun --nproc-per-node N bench/python_backend.py [--min-time 0.3] [--max-bytes 64M]

The default group is commgrad's; a second group over the same ranks is
Gloo's, so both run on the same processes, one after the other for each size.
Time is the mean per call over at least --min-time seconds after a warm-up,
the slowest rank's (nccl-tests reports the same), algbw = bytes / time,
busbw = algbw * 2 (n - 1) / n; #wrong counts elements that differ from the
closed form (every rank contributes rank + 1).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import commgrad


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def timed(fn, min_time, group):
    """Mean seconds per call of `fn`, the slowest rank's. Rank 0 picks the
    number of calls from a short calibration, so that the timed loop itself
    holds nothing but `fn`."""
    for _ in range(3):
        fn()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    estimate = (time.perf_counter() - t0) / 3
    iters = torch.tensor([max(5, int(min_time / max(estimate, 1e-7)))])
    dist.broadcast(iters, src=dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0, group=group)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(int(iters.item())):
        fn()
    mean = torch.tensor([(time.perf_counter() - t0) / int(iters.item())])
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)
    return mean.item()


def all_reduce_table(groups, min_time, max_bytes):
    n, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        head = f"{'size':>10} {'count':>10} {'type':>6}"
        for name in groups:
            head += f" | {name + ' time(us)':>17} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        print(f"# all_reduce SUM float32, {n} ranks (GB/s)\n{head}\n{'-' * len(head)}", flush=True)
    size = 4096
    while size <= max_bytes:
        count = size // 4
        row = f"{size:>10} {count:>10} {'float':>6}"
        for name, group in groups.items():
            x = torch.full((count,), float(rank + 1))
            t = timed(lambda: dist.all_reduce(x, group=group), min_time, group)
            y = torch.full((count,), float(rank + 1))
            dist.all_reduce(y, group=group)
            wrong = torch.tensor([(y != n * (n + 1) / 2).sum().item()])
            dist.all_reduce(wrong, group=group)
            algbw = size / t / 1e9
            row += f" | {t * 1e6:>17.1f} {algbw:>7.2f} {algbw * 2 * (n - 1) / n:>7.2f} {int(wrong.item()):>6}"
        if rank == 0:
            print(row, flush=True)
        size *= 4


def ddp_step_times(groups, min_time, hidden, layers, batch):
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    results = {}
    for name, group in groups.items():
        torch.manual_seed(0)
        mods = []
        for _ in range(layers):
            mods += [nn.Linear(hidden, hidden), nn.GELU()]
        net = DDP(nn.Sequential(*mods), process_group=group)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)

        def step():
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        results[name] = timed(step, min_time, group)
    params = sum(p.numel() for p in net.parameters())
    if rank == 0:
        print(f"\n# DDP step, MLP {layers} x Linear({hidden}, {hidden}) ({params / 1e6:.1f} M parameters, "
              f"{params * 4 / 2**20:.0f} MiB of gradients), batch {batch}, {dist.get_world_size()} ranks")
        for name, t in results.items():
            print(f"{name:>10}: {t * 1e3:8.1f} ms/step")
        names = list(results)
        print(f"{'speedup':>10}: {results[names[1]] / results[names[0]]:8.2f}x ({names[0]} vs {names[1]})", flush=True)


def fsdp2_step_times(groups, min_time, hidden, layers, batch):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    results = {}
    for name, group in groups.items():
        torch.manual_seed(0)
        net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.GELU())])
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in net[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)

        def step():
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        results[name] = timed(step, min_time, group)
    if dist.get_rank() == 0:
        print(f"\n# FSDP2 step (fully_shard per Linear), the same MLP, batch {batch}, {dist.get_world_size()} ranks")
        for name, t in results.items():
            print(f"{name:>10}: {t * 1e3:8.1f} ms/step")
        names = list(results)
        print(f"{'speedup':>10}: {results[names[1]] / results[names[0]]:8.2f}x ({names[0]} vs {names[1]})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per size and backend")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--ddp-hidden", type=int, default=1024)
    p.add_argument("--ddp-layers", type=int, default=4)
    p.add_argument("--ddp-batch", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("commgrad")
    groups = {"commgrad": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    if dist.get_rank() == 0:
        print(f"# {commgrad.build_info()}; torch {torch.__version__}; commgrad transport: {commgrad.transport()}")
    all_reduce_table(groups, args.min_time, parse_bytes(args.max_bytes))
    ddp_step_times(groups, args.min_time, args.ddp_hidden, args.ddp_layers, args.ddp_batch)
    fsdp2_step_times(groups, args.min_time, args.ddp_hidden, args.ddp_layers, args.ddp_batch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
