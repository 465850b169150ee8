"""PyTorch's own parallelism trained a few steps on the backend named by argv[1]:
DistributedDataParallel (plain, with a comm hook, with no_sync), a
tensor-parallel MLP (DTensor parallelize_module), FSDP2 (fully_shard),
torch.distributed.nn.functional's differentiable collectives, and a 2-D
DeviceMesh's sub-groups.

    torchrun --nproc-per-node N training.py BACKEND OUT_DIR

Every rank writes its losses and final parameters to OUT_DIR/rank<r>.pt; the
test compares "commgrad" with "gloo" (and each with the one-process result
where the parallelism is exact).
"""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from common import Checks, init

BACKEND, OUT_DIR = sys.argv[1], sys.argv[2]
RANK, N = init(BACKEND)
STEPS = 20
DIM, HIDDEN = 16, 24  # HIDDEN divisible by 1-4 ranks (DTensor shards it)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)


def params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def ddp(hook, accumulate):
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = DDP(model())
    if hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        net.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "custom":
        # A hand-written hook on the async handle's future: sum, then average.
        def hook_fn(state, bucket):
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0].div_(N))
        net.register_comm_hook(None, hook_fn)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        if accumulate:
            x, y = batch(step, 2 * RANK)
            with net.no_sync():
                nn.functional.mse_loss(net(x), y).backward()
            x, y = batch(step, 2 * RANK + 1)
        else:
            x, y = batch(step, RANK)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    # Every rank holds the same parameters.
    p = params(net.module)
    gathered = [torch.zeros_like(p) for _ in range(N)]
    dist.all_gather(gathered, p)
    for r in range(N):
        assert torch.equal(gathered[r], p), f"ddp: rank {r}'s parameters differ from rank {RANK}'s"
    return {"losses": torch.stack(losses), "params": p}


def ddp_reference(accumulate):
    """The same training in one process: the mean of every rank's loss."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(N):
            if accumulate:
                for k in (2 * r, 2 * r + 1):
                    x, y = batch(step, k)
                    (nn.functional.mse_loss(net(x), y) / N).backward()
            else:
                x, y = batch(step, r)
                (nn.functional.mse_loss(net(x), y) / N).backward()
        opt.step()
    return params(net)


def tensor_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (N,))
    reference = model()
    net = parallelize_module(copy.deepcopy(reference), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 0)  # the same batch on every rank of the TP group
        for m, o in ((net, opt), (reference, ref_opt)):
            o.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            if m is net:
                losses.append(loss.detach())
    full = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
    assert torch.allclose(full, params(reference), atol=1e-5), "tp: parameters differ from one process's"
    return {"losses": torch.stack(losses), "params": full}


def fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (N,))
    net = model()
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, RANK)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    full = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
    return {"losses": torch.stack(losses), "params": full}


def distributed_nn():
    """torch.distributed.nn.functional: the founding example (all_reduce
    forward and backward both sum over ranks) and all_gather's backward."""
    import torch.distributed.nn.functional as F
    x = torch.ones(4, requires_grad=True)
    y = F.all_reduce(x)
    y.sum().backward()
    assert torch.equal(y.detach(), torch.full((4,), float(N))), y
    assert torch.equal(x.grad, torch.full((4,), float(N))), x.grad
    z = torch.full((3,), float(RANK + 1), requires_grad=True)
    parts = F.all_gather(z)
    torch.cat(parts).mul(torch.arange(1.0, 3 * N + 1)).sum().backward()
    # d/dz_r of sum_j w_j * gathered_j, summed over every rank's loss.
    want = N * torch.arange(1.0, 3 * N + 1)[3 * RANK:3 * RANK + 3]
    assert torch.equal(z.grad, want), (z.grad, want)
    return {"y": y.detach(), "grad": x.grad, "gather_grad": z.grad}


def device_mesh_2d():
    """A 2 x 2 DeviceMesh (DP x TP): its sub-groups reduce over their own ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, N // 2), mesh_dim_names=("dp", "tp"))
    x = torch.full((4,), float(RANK + 1))
    dist.all_reduce(x, group=mesh.get_group("tp"))
    y = torch.full((4,), float(RANK + 1))
    dist.all_reduce(y, group=mesh.get_group("dp"))
    tp = [r for r in range(N) if r // (N // 2) == RANK // (N // 2)]
    dp = [r for r in range(N) if r % (N // 2) == RANK % (N // 2)]
    assert torch.equal(x, torch.full((4,), float(sum(r + 1 for r in tp)))), (x, tp)
    assert torch.equal(y, torch.full((4,), float(sum(r + 1 for r in dp)))), (y, dp)
    return {"tp": x, "dp": y}


checks = Checks(BACKEND, OUT_DIR)
if N % 2 == 0:
    checks.run("device_mesh_2d", device_mesh_2d)
checks.run("distributed_nn", distributed_nn)
for accumulate in (False, True):
    ref = ddp_reference(accumulate)
    for hook in ("none", "allreduce", "custom"):
        name = f"ddp/{hook}{'/no_sync' if accumulate else ''}"

        def run_ddp(hook=hook, accumulate=accumulate, ref=ref):
            got = ddp(hook, accumulate)
            assert torch.allclose(got["params"], ref, atol=1e-5), \
                f"parameters differ from one process's by {(got['params'] - ref).abs().max().item()}"
            return got
        checks.run(name, run_ddp)
checks.run("tp_mlp", tensor_parallel)
checks.run("fsdp2", fsdp2)
checks.finish()
dist.destroy_process_group()
