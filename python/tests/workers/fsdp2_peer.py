"""The Python side of test_fsdp2_cross_check.py: FSDP2 (fully_shard per
Linear, then the root) trains the model of tests/fsdp/fsdp2_peer_job.cpp
from the same initial weights and data; rank 0 writes the losses and the
final parameters.

    torchrun --nproc-per-node=2 fsdp2_peer.py commgrad INIT.safetensors OUT.safetensors
"""

import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import init


def main(backend, init_path, out_path):
    rank, n = init(backend)
    data = load_file(init_path)
    x, y = data["x"], data["y"]
    net = nn.Sequential(nn.Linear(x.shape[2], data["0.weight"].shape[0]), nn.ReLU(),
                        nn.Linear(data["2.weight"].shape[1], data["2.weight"].shape[0]), nn.ReLU(),
                        nn.Linear(data["4.weight"].shape[1], y.shape[2]))
    net.load_state_dict({k: v for k, v in data.items() if k not in ("x", "y")})
    mesh = init_device_mesh("cpu", (n,))
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    # foreach=False: the per-tensor update LibTorch's Adam computes.
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(x.shape[0]):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x[step].chunk(n)[rank]), y[step].chunk(n)[rank])
        loss.backward()
        opt.step()
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(mean / n)
    out = {k: v.full_tensor().contiguous() for k, v in net.state_dict().items()}
    out["losses"] = torch.cat(losses)
    if rank == 0:
        save_file(out, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
