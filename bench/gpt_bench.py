#!/usr/bin/env python3
"""The training step of gpt_bench.cpp in Python PyTorch, the way a PyTorch user writes it.

The GPT of examples/gpt (learned positions, pre-LayerNorm causal attention
blocks, final LayerNorm, output layer, cross entropy) at the same sizes and
initialisation statistics (nn.Linear's uniform +-1/sqrt(in); embedding and
output N(0, 1)/sqrt(h); positions N(0, 0.02)), AdamW (3e-3, weight decay
0.01) with global gradient-norm clipping at 1.0, float32 on the CPU, one
intra-op thread per rank, Gloo:

  PP  torch.distributed.pipelining: one PipelineStage per stage (v per rank,
      stage s on rank s % p), ScheduleGPipe / Schedule1F1B /
      ScheduleInterleaved1F1B, gradients scaled by 1/m (scale_grads).
  TP  parallelize_module over a DeviceMesh: the embedding RowwiseParallel
      (vocabulary-parallel), qkv and fc1 ColwiseParallel, dense and fc2
      RowwiseParallel, the output layer ColwiseParallel.
  DP  DistributedDataParallel on each stage (the pipeline stage calls
      no_sync until the last microbatch); without PP, m microbatches of
      gradient accumulation under no_sync.

What differs from the C++ model, and why:
  - The output layer has its own weight: pipelining cannot share a
    parameter between stages on different ranks, so gpt_bench.cpp runs with
    --untie for the comparison (bench/compare_gpt.sh).
  - Under TP the logits are all-gathered (output_layouts=Replicate()) and
    the loss is plain cross entropy: a pipeline stage's output and the
    schedule's loss must be plain tensors, so loss_parallel's
    vocabulary-parallel cross entropy (what commgrad does) does not fit in a
    stage. At vocabulary 256 the gathered logits are small.
  - DDP (all-reduce, full AdamW step) where commgrad runs ZeRO-2
    (reduce-scatter, a shard's step, all-gather): the same traffic.
  - The clipping norm is summed by hand over TP (sharded gradients) and PP
    (clip_grad_norm_ takes neither a mix of DTensors and tensors nor a
    pipeline's stages).

    torchrun --nproc-per-node 2 bench/gpt_bench.py [--layout TP,PP,DP[,SCHEDULE[,V]]]... [--steps 5]
    python bench/gpt_bench.py --summarize OUT_DIR      # the tables of bench/compare_gpt.sh

Rank 0 prints a table like gpt_bench.cpp's (no bubble columns: the schedule
does not report per-rank compute time).
"""

import argparse
import glob
import math
import os
import re
import statistics
import sys
import time


def parse_layout(text):
    parts = text.split(",")
    if not 3 <= len(parts) <= 5:
        raise SystemExit(f"--layout '{text}': expected TP,PP,DP[,SCHEDULE[,V]]")
    tp, pp, dp = (int(p) for p in parts[:3])
    schedule = parts[3] if len(parts) > 3 else "1f1b"
    v = int(parts[4]) if len(parts) > 4 else (2 if schedule == "interleaved" else 1)
    return tp, pp, dp, schedule, v


def default_layouts(n):
    if n == 1:
        return [(1, 1, 1, "1f1b", 1)]
    if n == 2:
        return [(1, 2, 1, "1f1b", 1), (1, 2, 1, "gpipe", 1), (1, 2, 1, "interleaved", 2), (1, 2, 1, "zbh1", 1),
                (2, 1, 1, "1f1b", 1), (1, 1, 2, "1f1b", 1)]
    if n == 4:
        return [(2, 2, 1, "1f1b", 1), (1, 2, 2, "1f1b", 1), (1, 4, 1, "1f1b", 1)]
    return [(1, n, 1, "1f1b", 1), (1, 1, n, "1f1b", 1)]


def layout_name(tp, pp, dp):
    return f"TP={tp} x PP={pp} x DP={dp}"


def build_model_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, h, heads):
            super().__init__()
            # Rows ordered head by head ([q; k; v] of head 0, then head 1, ...),
            # so ColwiseParallel's split along the rows gives each rank whole heads.
            self.qkv = nn.Linear(h, 3 * h)
            self.dense = nn.Linear(h, h)
            self.d = h // heads

        def forward(self, x):  # [b, s, h]
            b, s, _ = x.shape
            mixed = self.qkv(x)
            heads = mixed.shape[-1] // (3 * self.d)  # this TP rank's heads
            q, k, v = mixed.view(b, s, heads, 3, self.d).permute(3, 0, 2, 1, 4)  # [b, heads, s, d] each
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d))
            future = torch.ones(s, s, dtype=torch.bool).triu(1)
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
            return self.dense(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, heads * self.d))

    class Layer(nn.Module):
        def __init__(self, h, heads, ffn):
            super().__init__()
            self.ln1 = nn.LayerNorm(h)
            self.attention = Attention(h, heads)
            self.ln2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, ffn)
            self.fc2 = nn.Linear(ffn, h)

        def forward(self, x):
            x = x + self.attention(self.ln1(x))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Stage(nn.Module):
        """Global stage `index` of `count`: layers [index L/count, (index+1) L/count)."""

        def __init__(self, a, index, count):
            super().__init__()
            self.first, self.last = index == 0, index == count - 1
            per = a.layers // count
            if self.first:
                torch.manual_seed(1)
                self.embedding = nn.Embedding(a.vocab, a.hidden)
                nn.init.normal_(self.embedding.weight, 0.0, 1.0 / math.sqrt(a.hidden))
                torch.manual_seed(2)
                self.positions = nn.Parameter(torch.randn(a.sequence, a.hidden) * 0.02)
            layers = {}
            for layer in range(index * per, (index + 1) * per):
                torch.manual_seed(100 + layer)
                layers[str(layer)] = Layer(a.hidden, a.heads, a.ffn)
            self.layers = nn.ModuleDict(layers)
            if self.last:
                self.final_norm = nn.LayerNorm(a.hidden)
                torch.manual_seed(3)
                self.output = nn.Linear(a.hidden, a.vocab, bias=False)
                nn.init.normal_(self.output.weight, 0.0, 1.0 / math.sqrt(a.hidden))

        def forward(self, x):
            if self.first:
                x = self.embedding(x) + self.positions
            for layer in self.layers.values():
                x = layer(x)
            if self.last:
                x = self.output(self.final_norm(x))
            return x

    return Stage


def tensor_parallel(stage, mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    if stage.first:
        plan["embedding"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for name in stage.layers:
        plan[f"layers.{name}.attention.qkv"] = ColwiseParallel()
        plan[f"layers.{name}.attention.dense"] = RowwiseParallel()
        plan[f"layers.{name}.fc1"] = ColwiseParallel()
        plan[f"layers.{name}.fc2"] = RowwiseParallel()
    if stage.last:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    return parallelize_module(stage, mesh, plan)


def clip_grad_norm(params, max_norm, tp_group, pp_group):
    """Clips by the norm of the whole model's gradient (TP shards summed, replicas once, PP stages summed)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded = torch.zeros(1, dtype=torch.float64)
    replicated = torch.zeros(1, dtype=torch.float64)
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            local = g.to_local()
            if any(pl.is_shard() for pl in g.placements):
                sharded += local.double().pow(2).sum()
            else:
                replicated += local.double().pow(2).sum()
            grads.append(local)
        else:
            replicated += g.double().pow(2).sum()
            grads.append(g)
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    coef = min(1.0, max_norm / (math.sqrt(total.item()) + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)


def run_layout(a, layout):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)
    from torch.nn.parallel import DistributedDataParallel

    tp, pp, dp, schedule, v = layout
    if pp == 1:
        v = 1
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    tp_group = mesh["tp"].get_group() if tp > 1 else None
    pp_group = mesh["pp"].get_group() if pp > 1 else None
    Stage = build_model_classes()
    count = pp * v
    modules = [Stage(a, k * pp + pp_rank, count) for k in range(v)]
    if tp > 1:
        modules = [tensor_parallel(m, mesh["tp"]) for m in modules]
    params = [p for m in modules for p in m.parameters()]
    if dp > 1:
        modules = [DistributedDataParallel(m, process_group=mesh["dp"].get_group()) for m in modules]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    m = a.microbatches

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, a.vocab), targets.reshape(-1))

    if pp > 1:
        # Static shapes: the stages' shape inference sends pickled objects,
        # which needs numpy (not installed in the project's environment).
        mb = a.batch // dp // m

        def example(index, output):
            if not output and index == 0:
                return torch.zeros(mb, a.sequence, dtype=torch.long)
            shape = (mb, a.sequence, a.vocab if output and index == count - 1 else a.hidden)
            return torch.empty(shape, requires_grad=True)  # requires_grad: its gradient travels

        stages = []
        for k, mod in enumerate(modules):
            index = k * pp + pp_rank
            stages.append(PipelineStage(mod, index, count, torch.device("cpu"), input_args=example(index, False),
                                        output_args=example(index, True), group=pp_group))
        if schedule == "interleaved":
            sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
        elif schedule == "zbh1":  # one stage per rank: torch's zero-bubble schedule in ZB-H1's form
            sched = ScheduleInterleavedZeroBubble(stages, n_microbatches=m, loss_fn=loss_fn)
        else:
            sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stages[0], n_microbatches=m, loss_fn=loss_fn)
    first_rank, last_rank = pp_rank == 0, pp_rank == pp - 1
    world = dist.get_world_size()

    def step(k):
        # The synthetic corpus of examples/gpt/corpus.h (its statistics, not its numbers).
        gen = torch.Generator().manual_seed(7 + k)
        start = torch.randint(0, a.vocab, (a.batch, 1), generator=gen)
        t = torch.arange(a.sequence + 1)
        tokens = (start * 5 + t * 3 + (t // 4) * 7) % a.vocab
        rows = tokens.chunk(dp)[dp_rank]
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        opt.zero_grad()
        loss = torch.zeros(1, dtype=torch.float64)
        if pp > 1:
            losses = []
            if first_rank and last_rank:
                sched.step(x, target=y, losses=losses)
            elif first_rank:
                sched.step(x)
            elif last_rank:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            if losses:
                loss += torch.stack([l.detach() for l in losses]).mean().item()
        else:
            model = modules[0]
            for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
                sync = dp > 1 and i == m - 1
                ctx = model.no_sync() if dp > 1 and not sync else torch.enable_grad()
                with ctx:
                    lm = loss_fn(model(xm), ym) / m
                    lm.backward()
                loss += lm.detach().item()
        clip_grad_norm(params, 1.0, tp_group, pp_group)
        opt.step()
        if last_rank:
            loss /= tp * dp
        else:
            loss.zero_()
        dist.all_reduce(loss)
        return loss.item()

    times = []
    loss = 0.0
    for k in range(a.warmup + a.steps):
        dist.barrier()
        start = time.perf_counter()
        loss = step(k)
        wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        if k >= a.warmup:
            times.append(wall.item())
    p50 = statistics.median(times)
    return a.batch * a.sequence / p50, 1e3 * p50, loss, world


def bench(a):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    speaker = dist.get_rank() == 0
    layouts = [parse_layout(t) for t in a.layout] if a.layout else default_layouts(n)
    if speaker:
        print(f"gpt_bench.py: {n} ranks (gloo), torch {torch.__version__}, GPT {a.layers} layers, hidden {a.hidden}, "
              f"{a.heads} heads, ffn {a.ffn}, vocab {a.vocab}, sequence {a.sequence}, untied output layer; "
              f"global batch {a.batch}, {a.microbatches} microbatches, {a.warmup} warm-up + {a.steps} measured steps\n")
        print("| layout | schedule | v | tokens/s | step p50 (ms) | loss |\n|---|---|---:|---:|---:|---:|", flush=True)
    notes = []
    for layout in layouts:
        tp, pp, dp, schedule, v = layout
        sched_name = "-" if pp == 1 else schedule
        if tp * pp * dp != n:
            notes.append(f"{layout_name(tp, pp, dp)} {sched_name}: skipped, it needs {tp * pp * dp} ranks "
                         f"and the job has {n}")
            continue
        tokens, ms, loss, _ = run_layout(a, layout)
        if speaker:
            print(f"| {layout_name(tp, pp, dp)} | {sched_name} | {1 if pp == 1 else v} | {tokens:.0f} | {ms:.1f} | "
                  f"{loss:.4f} |", flush=True)
    if speaker:
        for note in notes:
            print(f"note: {note}")
    dist.destroy_process_group()


ROW = re.compile(r"^(?:\[0\] )?\| (TP=\d+ x PP=\d+ x DP=\d+) \| (\S+) \| (\d+) \| ([0-9.]+) \| ([0-9.]+) \|(.*)$")


def read_rows(path):
    """{(layout, schedule, v): (tokens/s, bubble, closed form)} of one output file."""
    rows = {}
    with open(path) as f:
        for line in f:
            m = ROW.match(line.rstrip("\n"))
            if not m:
                continue
            rest = [c.strip() for c in m.group(6).split("|") if c.strip()]
            # bubble measured, closed form, the busiest rank's idle share
            bubble = (float(rest[0]), float(rest[1]), float(rest[3])) if len(rest) >= 6 else None
            rows[(m.group(1), m.group(2), m.group(3))] = (float(m.group(4)), bubble)
    return rows


def summarize(directory):
    """Medians over the rounds of bench/compare_gpt.sh's outputs, the ratios, and an SVG of the ratios."""
    out = []
    for n in sorted({int(re.search(r"n(\d+)", os.path.basename(p)).group(1))
                     for p in glob.glob(os.path.join(directory, "*_n*_r*.txt"))}):
        cpp = [read_rows(p) for p in sorted(glob.glob(os.path.join(directory, f"cpp_n{n}_r*.txt")))]
        py = [read_rows(p) for p in sorted(glob.glob(os.path.join(directory, f"py_n{n}_r*.txt")))]
        keys = [k for k in (cpp[0] if cpp else {}) if all(k in r for r in cpp + py)]
        out.append(f"\n{n} ranks, {len(cpp)} rounds (medians; per round commgrad / Python in brackets):\n")
        out.append("| layout | schedule | v | commgrad tokens/s | Python tokens/s | commgrad / Python | "
                   "bubble measured | closed form | measured / closed | busiest rank / closed |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for k in keys:
            c = statistics.median(r[k][0] for r in cpp)
            p = statistics.median(r[k][0] for r in py)
            per_round = ", ".join(f"{a[k][0] / b[k][0]:.2f}" for a, b in zip(cpp, py))
            bubble = statistics.median(r[k][1][0] for r in cpp)
            closed = statistics.median(r[k][1][1] for r in cpp)  # zbh1's follows the measured costs
            busiest = statistics.median(r[k][1][2] for r in cpp)
            ratio = f"{bubble / closed:.2f}" if closed > 0 else "-"
            busiest_ratio = f"{busiest / closed:.2f}" if closed > 0 else "-"
            out.append(f"| {k[0]} | {k[1]} | {k[2]} | {c:.0f} | {p:.0f} | **{c / p:.2f}** ({per_round}) | "
                       f"{bubble:.3f} | {closed:.3f} | {ratio} | {busiest_ratio} |")
    print("\n".join(out))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", action="append", default=[], help="TP,PP,DP[,SCHEDULE[,V]] (repeatable)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sequence", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--summarize", metavar="DIR", help="print the comparison tables of bench/compare_gpt.sh's outputs")
    a = p.parse_args()
    if a.summarize:
        summarize(a.summarize)
    else:
        bench(a)


if __name__ == "__main__":
    sys.exit(main())
