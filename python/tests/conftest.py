"""Runs worker scripts (tests/workers/) in real processes under torchrun."""

import os
import subprocess
import sys
import time

import pytest

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
# A job that hangs fails the test instead of the suite.
JOB_TIMEOUT_S = 240


def _segments():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("commgrad-shm-")}
    except FileNotFoundError:
        return set()


class Job:
    def __init__(self, returncode, output):
        self.returncode = returncode
        self.output = output


def torchrun(nproc, worker, *args, env=None, expect_ok=True, timeout=JOB_TIMEOUT_S):
    """Runs tests/workers/<worker> on `nproc` local ranks under torchrun and
    returns its exit code and output. With `expect_ok`, fails the test unless
    every rank exited 0. Either way fails it when the job left shared-memory
    segments behind in /dev/shm."""
    before = _segments()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.2", os.path.join(WORKERS, worker), *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    full_env.update(env or {})
    try:
        p = subprocess.run(cmd, env=full_env, cwd=WORKERS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout)
        job = Job(p.returncode, p.stdout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{worker} on {nproc} ranks did not finish within {timeout}s:\n{out[-6000:]}")
    if expect_ok and job.returncode != 0:
        pytest.fail(f"{worker} {' '.join(map(str, args))} on {nproc} ranks exited {job.returncode}:\n"
                    f"{job.output[-8000:]}")
    left = _segments() - before
    if left:
        time.sleep(1.0)  # another job's segment lives for milliseconds before it is unlinked
        left &= _segments()
    assert not left, f"{worker} left shared-memory segments in /dev/shm: {sorted(left)}"
    return job


@pytest.fixture
def run():
    return torchrun
