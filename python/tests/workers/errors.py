"""Bad input and failures on the "commgrad" backend: clear errors naming op,
rank, group and shapes, never a hang.

    torchrun --nproc-per-node 2 errors.py MODE

MODE "input": mismatched and malformed arguments, then a timeout on a
sub-group; the world group still works afterwards. MODE "dead_peer": rank 1
exits in the middle of the job; rank 0's next collective fails within the
group's timeout, naming the rank that is gone.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from common import init

MODE = sys.argv[1]
RANK, N = init("commgrad", timeout_s=30)
results = []


# The Python class each kind of commgrad error arrives as: torch translates
# the C++ bases of commgrad's error types (include/commgrad/util/error.h).
# A bad argument stays a RuntimeError (as Gloo's), so that code written for
# Gloo catches the same; "not DistError" tells it from the other kinds.
INVALID_ARGUMENT = (RuntimeError, "not DistError")
MISMATCH = (dist.DistBackendError, None)
COMMUNICATION = (dist.DistBackendError, None)
TIMEOUT = (dist.DistNetworkError, None)


def kind_problem(e, kind):
    if kind is None:
        return None
    cls, extra = kind
    if not isinstance(e, cls):
        return f"raised {type(e).__name__}, expected {cls.__name__}"
    if extra == "not DistError" and isinstance(e, dist.DistError):
        return f"raised {type(e).__name__}, expected a plain RuntimeError"
    return None


def expect_error(name, fn, *needles, kind=None):
    """`fn` must raise, within seconds, an error whose message has every
    needle (and, given `kind`, of that Python class)."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        took = time.monotonic() - t0
        problem = kind_problem(e, kind)
        status = "ok" if not missing and not problem else (problem or f"missing {missing}")
        results.append((name, status, took, msg.splitlines()[0][:300]))
        return
    results.append((name, "no error", time.monotonic() - t0, ""))


def report():
    for name, status, took, msg in results:
        print(f"[rank {RANK}] CHECK {name}: {status} ({took:.1f}s): {msg}", flush=True)
    bad = [r for r in results if r[1] != "ok"]
    print(f"[rank {RANK}] errors: {len(results) - len(bad)} of {len(results)} checks passed", flush=True)
    return not bad


def coalesced_rejections():
    """A coalesced call whose parts are rejected on different ranks (rank k
    rejects part k): every rank fails, and the group stays in step."""
    C = torch._C._distributed_c10d
    pg = dist.distributed_c10d._get_default_group()
    opts = C.AllgatherOptions()
    opts.asyncOp = False
    ins = [torch.ones(3) for _ in range(N)]
    outs = [torch.zeros(3 * N + (1 if k == RANK else 0)) for k in range(N)]
    expect_error("coalesced parts rejected on different ranks",
                 lambda: pg.allgather_into_tensor_coalesced(outs, ins, opts), "allgather", "rank ")
    z = torch.ones(4)
    dist.all_reduce(z)
    assert torch.equal(z, torch.full((4,), float(N))), z
    good = [torch.zeros(3 * N) for _ in range(2)]
    work = pg.allgather_into_tensor_coalesced(good, [torch.full((3,), float(RANK))] * 2, opts)
    if work is not None:
        work.wait()
    want = torch.arange(N, dtype=torch.float32).repeat_interleave(3)
    assert all(torch.equal(g, want) for g in good), good


def wait_with_timeout():
    """Work.wait(timeout) gives up after that timeout, not the group's; the
    collective still completes when the late rank arrives."""
    group = dist.new_group(list(range(N)), timeout=datetime.timedelta(seconds=20))
    x = torch.ones(1 << 20)  # queued: not run inside the call
    if RANK == 0:
        work = dist.all_reduce(x, group=group, async_op=True)
        expect_error("wait(timeout)", lambda: work.wait(timeout=datetime.timedelta(seconds=1)), "timed out")
        took = results[-1][2]
        if not 0.9 < took < 4:
            results.append(("wait(timeout) took its timeout", f"took {took:.1f}s", took, ""))
    dist.barrier()
    if RANK != 0:
        dist.all_reduce(x, group=group)
    else:
        work.wait()
    assert torch.equal(x[:4], torch.full((4,), float(N))), x[:4]


def monitored_barrier():
    """Gloo's monitored_barrier: passes when every rank comes; rank 0 names
    the first rank that does not (every one with wait_all_ranks); the ranks
    that came say rank 0 did not release them."""
    timeout = datetime.timedelta(seconds=2)
    dist.monitored_barrier(timeout=timeout)
    dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    if RANK == 0:
        expect_error("monitored_barrier names the late rank", lambda: dist.monitored_barrier(timeout=timeout),
                     "Rank 1 failed to pass monitoredBarrier in 2000 ms")
        late = ", ".join(str(r) for r in range(1, N))
        expect_error("monitored_barrier wait_all_ranks",
                     lambda: dist.monitored_barrier(timeout=timeout, wait_all_ranks=True),
                     f"Ranks {late} failed to pass monitoredBarrier")
        expect_error("monitored_barrier without time", lambda: dist.monitored_barrier(timeout=datetime.timedelta(0)),
                     "Rank 0 timed out in monitoredBarrier")
    elif RANK > 1:
        expect_error("monitored_barrier not released", lambda: dist.monitored_barrier(timeout=timeout),
                     f"Rank {RANK} successfully reached monitoredBarrier, but received errors while waiting for "
                     "send/recv from rank 0")
    dist.barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))  # still in step


if MODE == "input":
    # Shapes that differ across ranks: both ranks fail, naming both shapes.
    expect_error("all_reduce shapes differ", lambda: dist.all_reduce(torch.ones(4 + RANK)),
                 "allreduce", f"rank {RANK}/{N}", "group", "16 bytes", "20 bytes", kind=MISMATCH)
    # dtypes that differ across ranks.
    expect_error("broadcast dtypes differ",
                 lambda: dist.broadcast(torch.ones(4, dtype=torch.float32 if RANK == 0 else torch.float64), src=0),
                 "broadcast", f"rank {RANK}/{N}", "Float", "Double")
    # A flat output of the wrong size (every rank).
    expect_error("all_gather_into_tensor output size",
                 lambda: dist.all_gather_into_tensor(torch.zeros(3 * N + 1), torch.ones(3)),
                 "allgather", f"rank {RANK}/{N}", "[3]", f"[{3 * N + 1}]", kind=INVALID_ARGUMENT)
    # An input that does not split into N equal parts.
    expect_error("reduce_scatter_tensor not divisible",
                 lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * N + 1)),
                 "reduce_scatter", f"rank {RANK}/{N}", f"[{2 * N + 1}]")
    # Splits that do not add up to the tensor.
    expect_error("all_to_all_single bad splits",
                 lambda: dist.all_to_all_single(torch.zeros(4), torch.ones(4), [1] * N, [3] * N),
                 "alltoall", f"rank {RANK}/{N}", "[4]")
    # A reduction that is not defined for the dtype.
    expect_error("bitwise and of floats", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND),
                 "allreduce", f"rank {RANK}/{N}", "BAND", "Float")
    # The world group still works after all of that.
    x = torch.ones(4)
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((4,), float(N))), x
    # A sub-group on which only rank 0 calls: it fails within its timeout.
    pair = dist.new_group(list(range(N)), timeout=datetime.timedelta(seconds=3))
    if RANK == 0:
        expect_error("timeout", lambda: dist.all_reduce(torch.ones(4), group=pair), "allreduce", "rank 0/", "group", "Timed out", "rank 1",
                     kind=TIMEOUT)
        took = results[-1][2]
        if took > 20:
            results.append(("timeout within the group's timeout", f"took {took:.1f}s", took, ""))
    dist.barrier()
    y = torch.ones(4)
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((4,), float(N))), y
    coalesced_rejections()
    wait_with_timeout()
    monitored_barrier()
    ok = report()
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)

if MODE == "dead_peer":
    group = dist.new_group(list(range(N)), timeout=datetime.timedelta(seconds=10))
    x = torch.ones(4)
    dist.all_reduce(x, group=group)
    if RANK == 1:
        os._exit(0)  # gone without a word; torchrun only notices at the end
    time.sleep(0.5)
    expect_error("dead peer", lambda: dist.all_reduce(torch.ones(1 << 16), group=group), "allreduce", "rank 0/", "rank 1", "died",
                 kind=COMMUNICATION)
    ok = report() and results[-1][2] < 20
    os._exit(0 if ok else 1)  # the world cannot shut down cleanly without rank 1
