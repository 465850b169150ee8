"""A process group that names its backend per device, as a GPU program does
("cpu:commgrad,cuda:nccl"): CPU tensors must go through commgrad, the other
device's through the backend named for it.

    torchrun --nproc-per-node N devices.py BACKEND_STRING OUT_DIR

BACKEND_STRING is "cpu:commgrad,cuda:<backend>": "cuda:gloo" where there is
no GPU (Gloo stands in for NCCL in that slot), "cuda:nccl" where there is one.
"""

import sys

import torch
import torch.distributed as dist

import commgrad
from common import Checks, init

BACKEND, OUT_DIR = sys.argv[1], sys.argv[2]
CUDA_BACKEND = dict(part.split(":") for part in BACKEND.split(","))["cuda"]
RANK, N = init(BACKEND)


def backends(group):
    """What c10d dispatches each device's tensors of `group` to."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg._get_backend(torch.device("cpu")), pg._get_backend(torch.device("cuda"))


def dispatch(group=None):
    assert dist.get_backend(group) == BACKEND, dist.get_backend(group)
    cpu, cuda = backends(group)
    assert cpu.name() == "commgrad", cpu.name()
    assert cuda.name() == CUDA_BACKEND, cuda.name()
    assert commgrad.transport(group) == "shm", commgrad.transport(group)
    # Every CPU collective is one call on commgrad's backend: its sequence
    # number counts them.
    before = cpu._get_sequence_number_for_group()
    x = torch.full((8,), float(RANK + 1))
    dist.all_reduce(x, group=group)
    work = dist.broadcast(torch.zeros(3), src=dist.get_global_rank(group, 0) if group else 0, group=group,
                          async_op=True)
    work.wait()
    calls = cpu._get_sequence_number_for_group() - before
    size = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group else list(range(size))
    assert torch.equal(x, torch.full((8,), float(sum(r + 1 for r in ranks)))), x
    assert calls == 2, f"commgrad's backend saw {calls} of the 2 CPU collectives"
    return {"x": x}


def objects():
    got = [None] * N
    dist.all_gather_object(got, {"rank": RANK})
    assert got == [{"rank": r} for r in range(N)], got


def parse():
    """The device map init_process_group makes of each string, one backend per device."""
    got = {}
    for cuda in ("gloo", "nccl"):
        text = f"cpu:commgrad,cuda:{cuda}"
        got[f"cuda:{cuda}"] = dist.distributed_c10d.BackendConfig(dist.Backend(text)).get_device_backend_map()
        assert got[f"cuda:{cuda}"] == {"cpu": "commgrad", "cuda": cuda}, got
    assert dist.Backend.backend_capability["commgrad"] == ["cpu"]
    return got


def cuda_tensors():
    x = torch.full((8,), float(RANK + 1), device="cuda")
    dist.all_reduce(x)
    assert torch.equal(x.cpu(), torch.full((8,), float(N * (N + 1) / 2))), x
    return {"x": x.cpu()}


checks = Checks(BACKEND, OUT_DIR)
checks.run("parse", parse)
checks.run("world", dispatch)
checks.run("objects", objects)
sub = dist.new_group([0, N - 1] if N > 1 else [0], backend=BACKEND)
if RANK in (0, N - 1):
    checks.run("new_group", dispatch, sub)
if torch.cuda.is_available():
    checks.run("cuda", cuda_tensors)
checks.finish()
dist.destroy_process_group()
