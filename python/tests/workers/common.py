"""Shared by the worker scripts that pytest starts under torchrun."""

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist


def init(backend, timeout_s=60):
    """Joins the torchrun job on `backend` ("commgrad", "gloo", or a device
    map such as "cpu:commgrad,cuda:gloo")."""
    if "commgrad" in backend:
        import commgrad  # noqa: F401  registers the backend
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


class Checks:
    """Runs named checks, records their results, and reports failures.

    Each check returns a dict of name -> tensor (what it computed, for the
    comparison between backends) after asserting its closed form. A check
    that raises is recorded as a failure; the run goes on (the collective was
    entered by every rank, so no rank is left waiting).
    """

    def __init__(self, backend, out_dir):
        self.backend = backend
        self.out_dir = out_dir
        self.results = {}
        self.failures = []
        self.count = 0

    def run(self, name, fn, *args):
        self.count += 1
        try:
            got = fn(*args)
            for key, value in (got or {}).items():
                self.results[f"{name}/{key}"] = value.detach().clone() if torch.is_tensor(value) else value
        except Exception as e:  # noqa: BLE001  reported below
            msg = f"{name}: {type(e).__name__}: {e}".splitlines()[0]
            self.failures.append(msg)
            if os.environ.get("COMMGRAD_TEST_TRACEBACK"):
                traceback.print_exc()

    def finish(self):
        rank = dist.get_rank()
        if self.out_dir:
            os.makedirs(self.out_dir, exist_ok=True)
            torch.save({"results": self.results, "failures": self.failures},
                       os.path.join(self.out_dir, f"rank{rank}.pt"))
        for f in self.failures:
            print(f"[rank {rank}] FAILED {f}", file=sys.stderr, flush=True)
        print(f"[rank {rank}] {self.backend}: {self.count - len(self.failures)} of {self.count} checks passed",
              flush=True)


def expect_equal(name, got, want):
    """Exact equality of a result and its closed form (same dtype and shape)."""
    want = want.to(got.dtype)
    if got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{name}: got {got.flatten()[:8].tolist()} (shape {tuple(got.shape)}), "
                             f"want {want.flatten()[:8].tolist()} (shape {tuple(want.shape)})")
