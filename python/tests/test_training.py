"""DDP (plain, comm hooks, no_sync), a DTensor tensor-parallel MLP and FSDP2
trained on "commgrad" and on "gloo": the same losses and parameters within
float32 tolerance (and, for DDP and TP, the one-process result)."""

import os

import pytest
import torch


# The 4-rank run names the backend by device, as a GPU program would
# ("cpu:commgrad,cuda:nccl" needs a GPU, see test_devices.py; Gloo takes the CUDA slot here).
@pytest.mark.parametrize("nproc,mine", [(2, "commgrad"), (4, "cpu:commgrad,cuda:gloo")])
def test_training_matches_gloo(run, tmp_path, nproc, mine):
    results = {}
    for backend in (mine, "gloo"):
        out = tmp_path / backend.replace(":", "_").replace(",", "_")
        job = run(nproc, "training.py", backend, out)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(nproc)]
        failures = [f"rank {r}: {f}" for r in range(nproc) for f in ranks[r]["failures"]]
        assert not failures, f"{backend}:\n" + "\n".join(failures) + "\n" + job.output[-4000:]
        results["gloo" if backend == "gloo" else "commgrad"] = ranks
    names = {k.split("/losses")[0] for k in results["gloo"][0]["results"] if k.endswith("/losses")}
    assert {"ddp/none", "ddp/allreduce", "ddp/custom", "ddp/none/no_sync", "tp_mlp", "fsdp2"} <= names, names
    for r in range(nproc):
        for key, want in results["gloo"][r]["results"].items():
            got = results["commgrad"][r]["results"][key]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {key}: {m}")
