"""A backend named per device ("cpu:commgrad,cuda:nccl"): CPU tensors go
through commgrad, CUDA tensors through the backend named for them."""

import os

import pytest
import torch


def check(run, tmp_path, nproc, backend):
    out = tmp_path / "out"
    job = run(nproc, "devices.py", backend, out)
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(nproc)]
    failures = [f"rank {r}: {f}" for r in range(nproc) for f in ranks[r]["failures"]]
    assert not failures, "\n".join(failures) + "\n" + job.output[-4000:]
    assert ranks[0]["results"]["parse/cuda:nccl"] == {"cpu": "commgrad", "cuda": "nccl"}
    assert "world/x" in ranks[0]["results"] and "new_group/x" in ranks[0]["results"], job.output[-4000:]
    assert "new_group/x" not in ranks[1]["results"]  # rank 1 is not in the sub-group [0, 2]


def test_cpu_tensors_go_through_commgrad_beside_another_cuda_backend(run, tmp_path):
    # Gloo stands in for NCCL in the CUDA slot on a machine without a GPU;
    # the job also checks that "cpu:commgrad,cuda:nccl" parses to the same map.
    check(run, tmp_path, 3, "cpu:commgrad,cuda:gloo")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch creates the NCCL backend of 'cpu:commgrad,cuda:nccl' in "
                           "init_process_group and raises 'nccl2 requires at least one CUDA device' (as it does "
                           "for 'cpu:gloo,cuda:nccl')")
def test_cpu_commgrad_cuda_nccl(run, tmp_path):
    check(run, tmp_path, 3, "cpu:commgrad,cuda:nccl")
