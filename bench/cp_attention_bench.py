"""PyTorch's ring attention (torch.distributed.tensor.experimental._context_parallel)
on CPU over Gloo, the Python twin of bench/cp_attention_bench.cpp.

PyTorch's context_parallel() intercepts the CUDA SDPA kernels only (flash,
efficient, cuDNN); on the CPU, scaled_dot_product_attention runs
aten._scaled_dot_product_flash_attention_for_cpu, which it does not
intercept. Its ring itself (_templated_ring_attention and its backward) takes
the kernel as an argument, so this script runs that ring with the CPU flash
kernel: the same algorithm (head-tail load balance, float32 log-sum-exp
merge, K/V rotated by all-to-all), PyTorch's fused kernel per block.

    torchrun --nproc-per-node 2 bench/cp_attention_bench.py --seq 4096
    python bench/cp_attention_bench.py --seq 4096          # CP = 1: the plain CPU flash kernel

One row per run, the columns of cp_attention_bench (time: median over steps
of the slowest rank; peak MB: maxrss over the RSS after warm-up).
"""
import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

aten = torch.ops.aten


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def head_tail(x, rank, size):
    chunks = x.chunk(2 * size, dim=2)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=2).contiguous()


class Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        out, lse = cpa._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, *_ = cpa._templated_ring_attention_backward(
            ctx.group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward, grad_out=dout,
            grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True,
            dropout_p=0.0)
        return dq, dk, dv, None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    w = int(os.environ.get("WORLD_SIZE", "1"))
    if w > 1:
        dist.init_process_group("gloo")
        cpa._cp_options.enable_load_balance = True
    rank = dist.get_rank() if w > 1 else 0
    g = torch.Generator().manual_seed(1)
    full = [torch.rand(1, a.heads, a.seq, a.head_dim, generator=g) for _ in range(4)]
    q, k, v, weight = [head_tail(x, rank, w) if w > 1 else x for x in full]
    for x in (q, k, v):
        x.requires_grad_()
    group = dist.group.WORLD if w > 1 else None
    times, base = [], rss_mb()
    for s in range(a.warmup + a.steps):
        if s == a.warmup and s > 0:
            base = rss_mb()
        for x in (q, k, v):
            x.grad = None
        if w > 1:
            dist.barrier()
        t0 = time.perf_counter()
        if w > 1:
            out = Ring.apply(q, k, v, group)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out * weight).sum().backward()
        if s >= a.warmup:
            times.append((time.perf_counter() - t0) * 1000)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    t = torch.tensor(times, dtype=torch.float64)
    pk = torch.tensor([peak], dtype=torch.float64)
    if w > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(pk, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{'torch-ring' if w > 1 else 'torch-sdpa':<11} {w:3d} {a.seq:6d} {t.median().item():10.1f} "
              f"{pk.item():10.1f}", flush=True)
    if w > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
