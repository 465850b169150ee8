"""C++ commgrad::fsdp::fully_shard against Python's FSDP2 (torch 2.15) on
commgrad's own torch.distributed backend: the same model (Linear 16-24-24-8
with ReLUs, one unit per Linear), the same initial weights and data (one
safetensors file), 8 Adam steps. The losses and the final parameters agree
within float32 rounding (rtol 1e-5, atol 1e-6), at 2 ranks and at 3 (where
every unit is padded)."""

import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, os.environ.get("COMMGRAD_BUILD_DIR", "build"))
LAUNCHER = os.path.join(BUILD, "bin", "commgrad-run")
JOB = os.path.join(BUILD, "tests", "fsdp", "fsdp2_peer_job")


def make_init(path, steps=8, batch=12, sizes=(16, 24, 24, 8)):
    g = torch.Generator().manual_seed(0)
    tensors = {"x": torch.randn(steps, batch, sizes[0], generator=g),
               "y": torch.randn(steps, batch, sizes[-1], generator=g)}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        tensors[f"{2 * i}.weight"] = torch.randn(fan_out, fan_in, generator=g) * fan_in ** -0.5
        tensors[f"{2 * i}.bias"] = torch.randn(fan_out, generator=g) * 0.1
    save_file(tensors, path)


@pytest.mark.skipif(not os.path.exists(JOB), reason="the C++ build (tests/fsdp/fsdp2_peer_job) is not there")
@pytest.mark.parametrize("nproc", [2, 3])
def test_cpp_fully_shard_follows_python_fsdp2(run, tmp_path, nproc):
    init = str(tmp_path / "init.safetensors")
    make_init(init)
    python_out, cpp_out = str(tmp_path / "python.safetensors"), str(tmp_path / "cpp.safetensors")
    run(nproc, "fsdp2_peer.py", "commgrad", init, python_out)
    cpp = subprocess.run([LAUNCHER, "-n", str(nproc), "--timeout", "120", JOB, init, cpp_out],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert cpp.returncode == 0, cpp.stdout[-4000:]
    want, got = load_file(python_out), load_file(cpp_out)
    assert sorted(want) == sorted(got)
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
