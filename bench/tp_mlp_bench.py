#!/usr/bin/env python3
"""The computation of tp_mlp_bench.cpp in Python PyTorch + torch.distributed.

A Megatron-style parallel MLP written the usual way (autograd Functions for
"f" and "g" around F.linear, Gloo all-reduces), timed like the C++ program:
forward + backward of [tokens, hidden] float32, a barrier before each step,
the per-step maximum over ranks, median and p10/p90 on rank 0.

    commgrad-run -n 2 .venv/bin/python bench/tp_mlp_bench.py   # TP = 2, 1 thread per rank
    .venv/bin/python bench/tp_mlp_bench.py --threads 2          # TP = 1, 2 threads

Run it with the python whose torch is the LibTorch the C++ program was built
against: the project's .venv (torch 2.15, the default line, made by
scripts/deps.sh) or, for the system line, Debian's /usr/bin/python3 with
python3-torch (1.13).
"""

import argparse
import ctypes
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class ParallelMLP(torch.nn.Module):
    def __init__(self, hidden, ffn, n):
        super().__init__()
        self.n = n
        self.w1 = torch.nn.Parameter(torch.randn(ffn // n, hidden) / hidden ** 0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(ffn // n))
        self.w2 = torch.nn.Parameter(torch.randn(hidden, ffn // n) / ffn ** 0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        if self.n > 1:
            x = CopyToTP.apply(x)
        h = F.gelu(F.linear(x, self.w1, self.b1))
        y = F.linear(h, self.w2)
        if self.n > 1:
            y = ReduceFromTP.apply(y)
        return y + self.b2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()

    n = int(os.environ.get("WORLD_SIZE", "1"))
    if n > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if n > 1 else 0
    threads = a.threads or (1 if n > 1 else 2)
    torch.set_num_threads(threads)
    # As in the C++ program: torch.set_num_threads does not reach OpenBLAS's
    # own thread pool.
    try:
        ctypes.CDLL("libopenblas.so.0").openblas_set_num_threads(threads)
    except (OSError, AttributeError):
        pass
    torch.manual_seed(1)
    mlp = ParallelMLP(a.hidden, a.ffn, n)
    x = torch.randn(a.tokens, a.hidden, requires_grad=True)

    times = []
    for step in range(a.warmup + a.steps):
        if n > 1:
            dist.barrier()
        t0 = time.perf_counter()
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        mlp(x).sum().backward()
        t1 = time.perf_counter()
        if step >= a.warmup:
            times.append((t1 - t0) * 1e3)
    t = torch.tensor(times, dtype=torch.float64)
    if n > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        s = sorted(t.tolist())
        q = lambda f: s[int(f * (len(s) - 1) + 0.5)]
        print(f"# tp_mlp_bench.py: Python torch {torch.__version__}, hidden {a.hidden} ffn {a.ffn} tokens {a.tokens} "
              f"float32, TP={n}, {threads} thread(s) per rank, {a.steps} steps")
        print(f"  step  p10 {q(0.1):.2f} ms  p50 {q(0.5):.2f} ms  p90 {q(0.9):.2f} ms")
    if n > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
