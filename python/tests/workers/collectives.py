"""Every collective torch.distributed offers a CPU backend, against closed
forms, on the backend named by argv[1] ("commgrad" or "gloo").

    torchrun --nproc-per-node N collectives.py BACKEND OUT_DIR [HOSTS]

Rank r's inputs are (r + 1) * base with small integer `base` values, so
every result is exact in every dtype (float16 and bfloat16 included) and has
a closed form. Each rank writes what it computed to OUT_DIR/rank<r>.pt so
that the test can compare the two backends. HOSTS > 0 gives rank r the host
identity "host<min(r, HOSTS - 1)>" (COMMGRAD_HOST; the last host has the
remaining ranks): groups then span "hosts" and commgrad carries them over
its hierarchical transport or Gloo.
"""

import os
import sys

import torch
import torch.distributed as dist

from common import Checks, expect_equal, init

BACKEND, OUT_DIR = sys.argv[1], sys.argv[2]
HOSTS = int(sys.argv[3]) if len(sys.argv) > 3 else 0
if HOSTS:
    os.environ["COMMGRAD_HOST"] = f"host{min(int(os.environ['RANK']), HOSTS - 1)}"
RANK, N = init(BACKEND)
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DTYPES = FLOATS + [torch.int64]
NUMEL = 12  # divisible by 1, 2, 3 and 4
R = dist.ReduceOp


def base(dtype, numel=NUMEL, period=5):
    return (torch.arange(numel) % period + 1).to(dtype)


def mine(dtype, rank=RANK, numel=NUMEL, period=5):
    return (rank + 1) * base(dtype, numel, period)


def noncontiguous(t):
    """The same values as `t` in a transposed (non-contiguous) view."""
    v = t.reshape(2, -1).t().contiguous().t()
    assert not v.is_contiguous() and torch.equal(v.reshape(-1), t)
    return v


def strided(t):
    """The same values as 1-D `t` in a strided (non-contiguous) view."""
    buf = torch.zeros(2 * t.numel(), dtype=t.dtype)
    buf[::2] = t
    return buf[::2]


def sum_ranks():
    return N * (N + 1) // 2


def all_reduce(dtype, op, contiguous):
    period = 2 if op == R.PRODUCT else 5
    x = mine(dtype, period=period)
    if not contiguous:
        x = noncontiguous(x)
    b = base(dtype, period=period).double()
    want = {
        R.SUM: sum_ranks() * b,
        R.AVG: (N + 1) / 2 * b,
        R.PRODUCT: torch.tensor(float(torch.arange(1, N + 1).prod())) * b**N,
        R.MIN: b,
        R.MAX: N * b,
    }.get(op)
    if op in (R.BAND, R.BOR, R.BXOR):
        vals = [mine(dtype, r, period=period) for r in range(N)]
        want = vals[0].clone()
        for v in vals[1:]:
            want = {R.BAND: want & v, R.BOR: want | v, R.BXOR: want ^ v}[op]
    dist.all_reduce(x, op=op)
    expect_equal("all_reduce", x.reshape(-1), want)
    return {"out": x.reshape(-1)}


def premul_sum(dtype):
    x = mine(dtype)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5))
    expect_equal("premul_sum", x, 0.5 * sum_ranks() * base(torch.float64))
    return {"out": x}


def broadcast(dtype, contiguous):
    src = N - 1
    x = mine(dtype)
    if not contiguous:
        x = noncontiguous(x)
    dist.broadcast(x, src=src)
    expect_equal("broadcast", x.reshape(-1), mine(dtype, src))
    return {"out": x.reshape(-1)}


def reduce(dtype, op):
    dst = N - 1
    x = mine(dtype)
    dist.reduce(x, dst=dst, op=op)
    if RANK == dst:
        want = sum_ranks() * base(torch.float64) if op == R.SUM else N * base(torch.float64)
        expect_equal("reduce", x, want)
        return {"out": x}
    return {}


def all_gather(dtype, contiguous):
    x = mine(dtype)
    if not contiguous:
        x = noncontiguous(x)
    outs = [torch.zeros(x.shape, dtype=dtype) for _ in range(N)]
    dist.all_gather(outs, x)
    for r in range(N):
        expect_equal(f"all_gather[{r}]", outs[r].reshape(-1), mine(dtype, r))
    return {"out": torch.cat([o.reshape(-1) for o in outs])}


def all_gather_uneven(dtype):
    x = mine(dtype, numel=RANK + 1)
    outs = [torch.zeros(r + 1, dtype=dtype) for r in range(N)]
    dist.all_gather(outs, x)
    for r in range(N):
        expect_equal(f"all_gather_uneven[{r}]", outs[r], mine(dtype, r, numel=r + 1))
    return {"out": torch.cat(outs)}


def all_gather_into_tensor(dtype, stacked):
    x = mine(dtype)
    out = torch.zeros((N, NUMEL) if stacked else (N * NUMEL,), dtype=dtype)
    dist.all_gather_into_tensor(out, x)
    want = torch.cat([mine(torch.float64, r) for r in range(N)])
    expect_equal("all_gather_into_tensor", out.reshape(-1), want)
    return {"out": out}


def reduce_scatter(dtype):
    chunk = NUMEL // N
    inputs = list(mine(dtype).split(chunk))
    out = torch.zeros(chunk, dtype=dtype)
    dist.reduce_scatter(out, inputs, op=R.SUM)
    expect_equal("reduce_scatter", out, sum_ranks() * base(torch.float64)[RANK * chunk:(RANK + 1) * chunk])
    return {"out": out}


def reduce_scatter_tensor(dtype, op, contiguous):
    chunk = NUMEL // N
    x = mine(dtype) if contiguous else strided(mine(dtype))
    out = torch.zeros(chunk, dtype=dtype)
    dist.reduce_scatter_tensor(out, x, op=op)
    factor = sum_ranks() if op == R.SUM else (N + 1) / 2
    expect_equal("reduce_scatter_tensor", out, factor * base(torch.float64)[RANK * chunk:(RANK + 1) * chunk])
    return {"out": out}


def all_to_all(dtype):
    chunk = NUMEL // N
    inputs = list(mine(dtype).split(chunk))
    outs = [torch.zeros(chunk, dtype=dtype) for _ in range(N)]
    dist.all_to_all(outs, inputs)
    for r in range(N):
        expect_equal(f"all_to_all[{r}]", outs[r], mine(torch.float64, r)[RANK * chunk:(RANK + 1) * chunk])
    return {"out": torch.cat(outs)}


def all_to_all_single(dtype, uneven, contiguous):
    if not uneven:
        chunk = NUMEL // N
        x = mine(dtype) if contiguous else strided(mine(dtype))
        out = torch.zeros(NUMEL, dtype=dtype)
        dist.all_to_all_single(out, x)
        want = torch.cat([mine(torch.float64, r)[RANK * chunk:(RANK + 1) * chunk] for r in range(N)])
        expect_equal("all_to_all_single", out, want)
        return {"out": out}
    # Rank r sends j + 1 elements of value 100 r + j to rank j.
    send = [torch.full((j + 1,), 100 * RANK + j).to(dtype) for j in range(N)]
    x = torch.cat(send)
    out = torch.zeros(N * (RANK + 1), dtype=dtype)
    dist.all_to_all_single(out, x, output_split_sizes=[RANK + 1] * N, input_split_sizes=[j + 1 for j in range(N)])
    want = torch.cat([torch.full((RANK + 1,), 100.0 * r + RANK) for r in range(N)])
    expect_equal("all_to_all_single_uneven", out, want)
    return {"out": out}


def gather_scatter(dtype):
    root = N - 1
    x = mine(dtype)
    outs = [torch.zeros(NUMEL, dtype=dtype) for _ in range(N)] if RANK == root else None
    dist.gather(x, outs, dst=root)
    got = {}
    if RANK == root:
        for r in range(N):
            expect_equal(f"gather[{r}]", outs[r], mine(dtype, r))
        got["gather"] = torch.cat(outs)
    y = torch.zeros(NUMEL, dtype=dtype)
    dist.scatter(y, [mine(dtype, r) for r in range(N)] if RANK == root else None, src=root)
    expect_equal("scatter", y, mine(dtype))
    got["scatter"] = y
    return got


def point_to_point(dtype):
    nxt, prev = (RANK + 1) % N, (RANK - 1) % N
    got = torch.zeros(NUMEL, dtype=dtype)
    if N == 1:
        return {}
    # Blocking send/recv: even ranks send first.
    if RANK % 2 == 0:
        dist.send(mine(dtype), nxt)
        dist.recv(got, prev)
    else:
        dist.recv(got, prev)
        dist.send(mine(dtype), nxt)
    expect_equal("send/recv", got, mine(dtype, prev))
    # isend / irecv.
    got2 = torch.zeros(NUMEL, dtype=dtype)
    reqs = [dist.isend(mine(dtype), nxt), dist.irecv(got2, prev)]
    for r in reqs:
        r.wait()
    expect_equal("isend/irecv", got2, mine(dtype, prev))
    # batch_isend_irecv, both directions of the ring.
    a, b = torch.zeros(NUMEL, dtype=dtype), torch.zeros(NUMEL, dtype=dtype)
    ops = [dist.P2POp(dist.isend, mine(dtype), nxt), dist.P2POp(dist.irecv, a, prev),
           dist.P2POp(dist.isend, 2 * mine(dtype), prev), dist.P2POp(dist.irecv, b, nxt)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    expect_equal("batch_isend_irecv(prev)", a, mine(dtype, prev))
    expect_equal("batch_isend_irecv(next)", b, 2 * mine(dtype, nxt))
    return {"recv": got, "irecv": got2, "batch": torch.cat([a, b])}


def all_gather_coalesced(count, dtype):
    """torch's contract: out[r][i] is input i of rank r. `count` inputs of
    different shapes (an empty one among them when count > 1; torch wants
    one dtype per call); count == N is the case a transposed result would
    pass silently."""
    shapes = [(2, 3), (0,), (5,), (1, 2, 2)]
    ins = [(RANK + 1) * (i + 1) * torch.ones(shapes[i % 4], dtype=dtype) for i in range(count)]
    outs = [[torch.full_like(t, -1) for t in ins] for _ in range(N)]
    dist.all_gather_coalesced(outs, ins)
    for r in range(N):
        for i, t in enumerate(ins):
            expect_equal(f"all_gather_coalesced out[{r}][{i}]", outs[r][i], (r + 1) * (i + 1) * torch.ones_like(t))
    return {f"{r}/{i}": outs[r][i] for r in range(N) for i in range(count)}


def recv_any_source():
    """Every rank but 0 sends its rank twice; rank 0 receives them without
    naming a source (recv, then irecv) and learns each sender."""
    if N == 1:
        return {}
    senders = []
    if RANK == 0:
        for _ in range(N - 1):
            t = torch.full((3,), -1.0)
            sender = dist.recv(t)
            expect_equal("recv from any source", t, torch.full((3,), float(sender)))
            senders.append(sender)
        for _ in range(N - 1):
            t = torch.full((3,), -1.0)
            work = dist.irecv(t)
            work.wait()
            sender = work._source_rank()
            expect_equal("irecv from any source", t, torch.full((3,), float(sender)))
            senders.append(sender)
        assert sorted(senders) == sorted(list(range(1, N)) * 2), senders
    else:
        dist.send(torch.full((3,), float(RANK)), 0)
        dist.send(torch.full((3,), float(RANK)), 0)
    dist.barrier()
    return {"senders": torch.tensor(sorted(senders), dtype=torch.int64)}


def sparse_all_reduce(sparse_dims, dense_dims):
    """Rank r contributes ones at rows 0..r (as torch's suite does): the sum
    is a sparse tensor whose dense form is known."""
    indices = torch.arange(RANK + 1).reshape(1, -1)
    for _ in range(sparse_dims - 1):
        indices = torch.cat([indices, torch.zeros(1, RANK + 1, dtype=torch.int64)])
    shape = [N] + [N] * (sparse_dims - 1) + [2] * dense_dims
    x = torch.sparse_coo_tensor(indices, torch.ones([RANK + 1] + [2] * dense_dims), shape)
    dist.all_reduce(x)
    want = torch.zeros(shape)
    for r in range(N):
        for i in range(r + 1):
            want[(i,) + (0,) * (sparse_dims - 1)] += 1
    assert x.is_sparse, x.layout
    expect_equal("sparse all_reduce", x.to_dense(), want)
    return {"dense": x.to_dense()}


def integer_avg(dtype, value):
    """An integer mean sums without overflowing the dtype (Gloo refuses AVG)."""
    x = torch.full((5,), value, dtype=dtype)
    dist.all_reduce(x, op=R.AVG)
    expect_equal(f"AVG of {value}", x, torch.full((5,), value, dtype=dtype))
    y = torch.full((5,), value - RANK, dtype=dtype)
    dist.all_reduce(y, op=R.AVG)
    total = sum(value - r for r in range(N))
    expect_equal("AVG truncates", y, torch.full((5,), total // N, dtype=dtype))
    return {}


def asynchronous():
    x = mine(torch.float32)
    work = dist.all_reduce(x, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    work.wait()
    expect_equal("async all_reduce", x, sum_ranks() * base(torch.float64))
    expect_equal("future.then", fut.wait(), 2 * sum_ranks() * base(torch.float64))
    outs = [torch.zeros(NUMEL) for _ in range(N)]
    w2 = dist.all_gather(outs, mine(torch.float32), async_op=True)
    w3 = dist.broadcast(y := mine(torch.float32), src=0, async_op=True)
    w2.wait()
    w3.wait()
    expect_equal("async broadcast", y, mine(torch.float64, 0))
    assert work.is_completed()
    return {"out": x, "then": fut.wait()}


def blocking():
    """A blocking call (asyncOp False, as torch.distributed's functions make
    it without async_op=True) is done when it returns, and commgrad returns
    no Work for it; inside allow_inflight_collective_as_graph_input_ctx it
    returns a finished Work, which torch keeps for wait_tensor."""
    from torch.distributed._functional_collectives import allow_inflight_collective_as_graph_input_ctx
    C = torch._C._distributed_c10d
    pg = dist.distributed_c10d._get_default_group()
    x = mine(torch.float32)
    opts = C.AllreduceOptions()
    opts.asyncOp = False
    work = pg.allreduce([x], opts)
    if work is not None:  # what torch.distributed does with a backend's Work (Gloo returns one)
        work.wait()
    expect_equal("blocking all_reduce", x, sum_ranks() * base(torch.float64))
    out = torch.zeros(N * NUMEL)
    gopts = C.AllgatherOptions()
    gopts.asyncOp = False
    coalesced = pg.allgather_into_tensor_coalesced([out], [mine(torch.float32)], gopts)
    if coalesced is not None:
        coalesced.wait()
    expect_equal("blocking all_gather_into_tensor_coalesced", out,
                 torch.cat([mine(torch.float64, r) for r in range(N)]))
    with allow_inflight_collective_as_graph_input_ctx():
        y = mine(torch.float32)
        kept = pg.allreduce([y], opts)
        torch.ops._c10d_functional.wait_tensor(y)
    expect_equal("blocking all_reduce in allow_inflight_collective_as_graph_input_ctx", y,
                 sum_ranks() * base(torch.float64))
    if BACKEND == "commgrad":
        assert work is None and coalesced is None, (work, coalesced)
        assert kept is not None and kept.is_completed()
    return {"out": x, "gathered": out}


def barrier():
    dist.barrier()
    return {}


def objects():
    obj = {"rank": RANK, "name": f"r{RANK}", "list": list(range(RANK))}
    gathered = [None] * N
    dist.all_gather_object(gathered, obj)
    assert gathered == [{"rank": r, "name": f"r{r}", "list": list(range(r))} for r in range(N)], gathered
    lst = [obj, "x"] if RANK == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [{"rank": 0, "name": "r0", "list": []}, "x"], lst
    g = [None] * N if RANK == 0 else None
    dist.gather_object(obj, g, dst=0)
    if RANK == 0:
        assert [o["rank"] for o in g] == list(range(N)), g
    out = [None]
    dist.scatter_object_list(out, [f"to{r}" for r in range(N)] if RANK == 0 else None, src=0)
    assert out == [f"to{RANK}"], out
    return {}


def subgroups():
    evens = list(range(0, N, 2))
    odds = list(range(1, N, 2))
    groups = [dist.new_group(evens), dist.new_group(odds) if odds else None]
    mine_group = groups[RANK % 2]
    x = mine(torch.float32)
    dist.all_reduce(x, group=mine_group)
    members = evens if RANK % 2 == 0 else odds
    expect_equal("subgroup all_reduce", x, sum(r + 1 for r in members) * base(torch.float64))
    outs = [torch.zeros(NUMEL) for _ in members]
    dist.all_gather(outs, mine(torch.float32), group=mine_group)
    for i, r in enumerate(members):
        expect_equal("subgroup all_gather", outs[i], mine(torch.float64, r))
    # The world still works after the sub-groups were made.
    y = mine(torch.float32)
    dist.all_reduce(y)
    expect_equal("world after new_group", y, sum_ranks() * base(torch.float64))
    got = {"sub": x, "world": y}
    if BACKEND == "commgrad":
        import commgrad
        got["transports"] = [commgrad.transport(), commgrad.transport(mine_group)]
        # The C++ object is a torch.distributed Backend, registered for CPU.
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert isinstance(backend, torch._C._distributed_c10d.Backend), type(backend)
        assert dist.get_backend() == "commgrad", dist.get_backend()
        assert commgrad.describe().startswith(f"rank {RANK}/{N} group "), commgrad.describe()
    return got


checks = Checks(BACKEND, OUT_DIR)
for dtype in DTYPES:
    name = str(dtype).replace("torch.", "")
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX] + ([R.AVG] if dtype in FLOATS else [R.BAND, R.BOR, R.BXOR])
    for op in ops:
        checks.run(f"all_reduce/{op}/{name}", all_reduce, dtype, op, True)
    checks.run(f"all_reduce_noncontiguous/{name}", all_reduce, dtype, R.SUM, False)
    if BACKEND == "commgrad" and dtype in FLOATS:
        checks.run(f"premul_sum/{name}", premul_sum, dtype)
    checks.run(f"broadcast/{name}", broadcast, dtype, True)
    checks.run(f"broadcast_noncontiguous/{name}", broadcast, dtype, False)
    checks.run(f"reduce_sum/{name}", reduce, dtype, R.SUM)
    checks.run(f"reduce_max/{name}", reduce, dtype, R.MAX)
    checks.run(f"all_gather/{name}", all_gather, dtype, True)
    checks.run(f"all_gather_noncontiguous/{name}", all_gather, dtype, False)
    checks.run(f"all_gather_uneven/{name}", all_gather_uneven, dtype)
    checks.run(f"all_gather_into_tensor/{name}", all_gather_into_tensor, dtype, False)
    checks.run(f"all_gather_into_tensor_stacked/{name}", all_gather_into_tensor, dtype, True)
    checks.run(f"reduce_scatter/{name}", reduce_scatter, dtype)
    checks.run(f"reduce_scatter_tensor/{name}", reduce_scatter_tensor, dtype, R.SUM, True)
    if dtype in FLOATS:
        checks.run(f"reduce_scatter_tensor_avg/{name}", reduce_scatter_tensor, dtype, R.AVG, True)
    checks.run(f"reduce_scatter_tensor_noncontiguous/{name}", reduce_scatter_tensor, dtype, R.SUM, False)
    checks.run(f"all_to_all/{name}", all_to_all, dtype)
    checks.run(f"all_to_all_single_noncontiguous/{name}", all_to_all_single, dtype, False, False)
    checks.run(f"all_to_all_single/{name}", all_to_all_single, dtype, False, True)
    checks.run(f"all_to_all_single_uneven/{name}", all_to_all_single, dtype, True, True)
    checks.run(f"gather_scatter/{name}", gather_scatter, dtype)
    checks.run(f"point_to_point/{name}", point_to_point, dtype)
for count, dtype in [(1, torch.float32), (3, torch.int64), (N, torch.float32), (4, torch.bfloat16)]:
    checks.run(f"all_gather_coalesced/{count}/{dtype}", all_gather_coalesced, count, dtype)
checks.run("recv_any_source", recv_any_source)
for sparse_dims, dense_dims in [(1, 0), (2, 0), (1, 2)]:
    checks.run(f"sparse_all_reduce/{sparse_dims}/{dense_dims}", sparse_all_reduce, sparse_dims, dense_dims)
if BACKEND == "commgrad":
    for dtype, value in [(torch.int8, 100), (torch.uint8, 250), (torch.int16, 32000), (torch.int32, 2**31 - 9),
                         (torch.int64, 2**40 + 5 if HOSTS else 2**62 + 5)]:  # across hosts int64 sums in int64
        checks.run(f"integer_avg/{dtype}", integer_avg, dtype, value)
checks.run("async", asynchronous)
checks.run("blocking", blocking)
checks.run("barrier", barrier)
checks.run("objects", objects)
checks.run("subgroups", subgroups)
checks.finish()
dist.destroy_process_group()
