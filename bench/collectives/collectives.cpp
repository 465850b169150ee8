// The descriptors of commgrad-bench: for each collective, the raw c10d call
// it is measured against, the differentiable op, the expected values and the
// bus-bandwidth factor of nccl-tests.
//
// Inputs are small integers, x_r[i] = (i mod 5) + r + 1, so every expected
// result is exact in any floating type. The raw call is the bare transport
// call on preallocated buffers, in place where c10d works in place; for
// all_gather the transport's call into one tensor where it has one (shm),
// else the list of rows; for reduce_scatter it is the transport's own where
// it has one (shm, hierarchical: TransportCapabilities), else, as Gloo lacks it, the
// alltoall_base that carries its traffic (the local sum is not counted), so
// the overhead column shows the whole cost of the workaround's local step.

#include "bench.h"

#include "commgrad/ops/async.h"
#include "commgrad/ops/collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>

namespace commgrad::bench {
namespace {

using commgrad::detail::WorkPtr;

at::Tensor pattern(int64_t count, int rank, at::ScalarType dtype) {
  return at::arange(count, at::kLong).remainder(5).add(rank + 1).to(dtype);
}

// A new tensor with `t`'s values that starts s.offset_bytes past a 64-byte
// boundary (--offset): a view into a larger buffer, as a slice of a flat
// buffer (a bucket, a shard) is. The raw calls' buffers are made with it.
// With an offset the storage has 4 KiB to spare whatever the offset, so
// that offsets 1 to 4095 place the view at every byte of one page.
at::Tensor placed(const Setup& s, const at::Tensor& t) {
  const auto elsize = static_cast<int64_t>(t.element_size());
  const int64_t skip = s.offset_bytes / elsize;
  auto storage = at::empty({t.numel() + (skip > 0 ? 4096 / elsize : 0)}, t.options());
  return storage.narrow(0, skip, t.numel()).view(t.sizes()).copy_(t);
}

void wait(const WorkPtr& w) { w->wait(); }

// Forward+backward through `op` with a gradient of ones.
std::function<void()> fwd_bwd(const at::Tensor& x, std::function<at::Tensor(const at::Tensor&)> op) {
  if (!at::isFloatingType(x.scalar_type())) return nullptr;
  auto leaf = x.detach().clone().requires_grad_(true);
  auto grad = std::make_shared<at::Tensor>();
  return [leaf, op, grad]() mutable {
    leaf.mutable_grad() = at::Tensor();
    auto y = op(leaf);
    if (!grad->defined()) *grad = at::ones_like(y);
    torch::autograd::backward({y}, {*grad});
  };
}

double all_factor(int n) { return n > 0 ? static_cast<double>(n - 1) / n : 0; }

// ~~~ link floors (docs/benchmarks.md): reductions inside a host are free ~~~

// all_reduce among H hosts: every host sends (and receives) at least
// 2 (H-1)/H of the buffer (a bandwidth-optimal all_reduce of H members);
// 2 (H-1) steps of a ring.
LinkCost all_reduce_link(const std::vector<int>& ranks_per_host) {
  const int h = static_cast<int>(ranks_per_host.size());
  return {h > 1 ? 2.0 * (h - 1) / h : 0, 2 * (h - 1)};
}

// all_gather (size = output) and reduce_scatter (size = input): the host of
// L ranks receives (all_gather) or sends (reduce_scatter) at least the n - L
// parts of the ranks elsewhere; the smallest host's link is the busiest.
// H - 1 steps of a ring.
LinkCost parts_link(const std::vector<int>& ranks_per_host) {
  const int h = static_cast<int>(ranks_per_host.size());
  int n = 0, smallest = ranks_per_host.empty() ? 0 : ranks_per_host.front();
  for (int l : ranks_per_host) {
    n += l;
    smallest = std::min(smallest, l);
  }
  return {h > 1 ? static_cast<double>(n - smallest) / n : 0, h - 1};
}

// ~~~ all_reduce ~~~

Instance all_reduce(const Setup& s) {
  Instance in;
  in.input = placed(s, pattern(s.count, s.rank, s.dtype));
  // Expected: a reduction over r of base + r + 1.
  auto base = at::arange(s.count, at::kLong).remainder(5).to(at::kDouble);
  at::Tensor want = base.add(1);
  for (int r = 1; r < s.size; ++r) {
    auto xr = base.add(r + 1);
    switch (s.op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        want = want + xr;
        break;
      case ReduceOp::kMax:
        want = at::maximum(want, xr);
        break;
      case ReduceOp::kMin:
        want = at::minimum(want, xr);
        break;
      case ReduceOp::kProduct:
        want = want * xr;
        break;
    }
  }
  if (s.op == ReduceOp::kAvg) want = want / s.size;
  want = want.to(s.dtype);
  auto buffer = placed(s, in.input);
  auto group = s.group;
  c10d::AllreduceOptions opts;
  opts.reduceOp = s.op == ReduceOp::kMax       ? c10d::ReduceOp::MAX
                  : s.op == ReduceOp::kMin     ? c10d::ReduceOp::MIN
                  : s.op == ReduceOp::kProduct ? c10d::ReduceOp::PRODUCT
                                               : c10d::ReduceOp::SUM;
  in.raw = [buffer, group, opts]() {
    std::vector<at::Tensor> t{buffer};
    wait(group.transport().allreduce(t, opts));
  };
  in.raw_source = buffer;
  const bool avg = s.op == ReduceOp::kAvg;
  const int n = s.size;
  in.check_raw = [=]() {
    buffer.copy_(in.input);
    std::vector<at::Tensor> t{buffer};
    wait(group.transport().allreduce(t, opts));
    return count_wrong(avg ? buffer / n : buffer, want);
  };
  const auto options = ops::AllReduceOptions().op(s.op);
  in.op = [options, group](const at::Tensor& x) { return ops::all_reduce(x, options, group); };
  in.check_op = [want](const at::Tensor& y) { return count_wrong(y, want); };
  if (s.op != ReduceOp::kProduct) in.forward_backward = fwd_bwd(in.input, in.op);
  return in;
}

// ~~~ all_gather: count = output elements ~~~

Instance all_gather(const Setup& s) {
  Instance in;
  const int n = s.size;
  const int64_t part = s.count / n;
  in.input = placed(s, pattern(part, s.rank, s.dtype));
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(pattern(part, r, s.dtype));
  auto want = at::cat(parts);
  auto out = placed(s, at::empty({n, part}, in.input.options()));
  auto group = s.group;
  auto x = in.input;
  auto run = [out, x, group, n, native = group.capabilities().all_gather]() {
    if (native) {  // the transport's own into one tensor (shm), as the op uses it
      at::Tensor o = out, i = x;
      wait(native(o, i, {}));
      return;
    }
    std::vector<std::vector<at::Tensor>> o(1);
    for (int r = 0; r < n; ++r) o[0].push_back(out[r]);
    std::vector<at::Tensor> i{x};
    wait(group.transport().allgather(o, i));
  };
  in.raw = run;
  in.raw_source = x;
  in.check_raw = [=]() {
    out.zero_();
    run();
    return count_wrong(out.view({-1}), want);
  };
  in.op = [group](const at::Tensor& x) { return ops::all_gather(x, {}, group); };
  in.check_op = [want](const at::Tensor& y) { return count_wrong(y, want); };
  in.forward_backward = fwd_bwd(in.input, in.op);
  return in;
}

// ~~~ reduce_scatter: count = input elements ~~~

Instance reduce_scatter(const Setup& s) {
  Instance in;
  const int n = s.size;
  const int64_t part = s.count / n;
  in.input = placed(s, pattern(s.count, s.rank, s.dtype));
  auto total = at::zeros({s.count}, at::kDouble);
  for (int r = 0; r < n; ++r) total += pattern(s.count, r, at::kDouble);
  if (s.op == ReduceOp::kAvg) total /= n;
  auto want = total.narrow(0, s.rank * part, part).to(s.dtype);
  auto group = s.group;
  auto x = in.input;
  const bool avg = s.op == ReduceOp::kAvg;
  in.raw_source = x;
  const auto& native = group.capabilities().reduce_scatter;
  if (native && at::isFloatingType(s.dtype) && s.op != ReduceOp::kProduct) {
    // The transport's own reduce_scatter (shm, hierarchical), as the op uses it.
    auto out = placed(s, at::empty({part}, in.input.options()));
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = s.op == ReduceOp::kMax   ? c10d::ReduceOp::MAX
                    : s.op == ReduceOp::kMin ? c10d::ReduceOp::MIN
                                             : c10d::ReduceOp::SUM;
    in.raw = [native, out, x, opts]() mutable {
      at::Tensor input = x;
      wait(native(out, input, opts));
    };
    in.check_raw = [=]() {
      in.raw();
      return count_wrong(avg ? out / n : out, want);
    };
  } else {
    auto received = placed(s, at::empty({n, part}, in.input.options()));
    in.raw = [received, x, group]() {
      std::vector<int64_t> none;
      at::Tensor out = received.view({-1}), input = x;
      wait(group.transport().alltoall_base(out, input, none, none));
    };
    in.check_raw = [=]() {
      in.raw();
      auto r = received.sum(0);
      return count_wrong(avg ? r / n : r, want);
    };
  }
  const auto options = ops::ReduceScatterOptions().op(s.op);
  in.op = [options, group](const at::Tensor& x) { return ops::reduce_scatter(x, options, group); };
  in.check_op = [want](const at::Tensor& y) { return count_wrong(y, want); };
  in.forward_backward = fwd_bwd(in.input, in.op);
  return in;
}

// ~~~ broadcast, reduce: count = elements ~~~

Instance broadcast(const Setup& s) {
  Instance in;
  in.input = placed(s, pattern(s.count, s.rank, s.dtype));
  auto want = pattern(s.count, s.root, s.dtype);
  auto buffer = placed(s, in.input);
  auto group = s.group;
  c10d::BroadcastOptions opts;
  opts.rootRank = s.root;
  in.raw = [buffer, group, opts]() {
    std::vector<at::Tensor> t{buffer};
    wait(group.transport().broadcast(t, opts));
  };
  if (s.rank == s.root) in.raw_source = buffer;
  in.check_raw = [=]() {
    buffer.copy_(in.input);
    in.raw();
    return count_wrong(buffer, want);
  };
  const auto options = ops::BroadcastOptions().src(s.root);
  in.op = [options, group](const at::Tensor& x) { return ops::broadcast(x, options, group); };
  in.check_op = [want](const at::Tensor& y) { return count_wrong(y, want); };
  in.forward_backward = fwd_bwd(in.input, in.op);
  return in;
}

Instance reduce(const Setup& s) {
  Instance in;
  in.input = placed(s, pattern(s.count, s.rank, s.dtype));
  auto total = at::zeros({s.count}, at::kDouble);
  for (int r = 0; r < s.size; ++r) total += pattern(s.count, r, at::kDouble);
  const bool root = s.rank == s.root;
  auto want = root ? total.to(s.dtype) : at::zeros({s.count}, s.dtype);
  auto buffer = placed(s, in.input);
  auto group = s.group;
  c10d::ReduceOptions opts;
  opts.rootRank = s.root;
  in.raw = [buffer, group, opts]() {
    std::vector<at::Tensor> t{buffer};
    wait(group.transport().reduce(t, opts));
  };
  in.raw_source = buffer;
  in.check_raw = [=]() {
    buffer.copy_(in.input);
    in.raw();
    return root ? count_wrong(buffer, want) : int64_t{0};
  };
  const auto options = ops::ReduceOptions().dst(s.root);
  in.op = [options, group](const at::Tensor& x) { return ops::reduce(x, options, group); };
  in.check_op = [want](const at::Tensor& y) { return count_wrong(y, want); };
  in.forward_backward = fwd_bwd(in.input, in.op);
  return in;
}

// ~~~ scatter, gather: count = the root's elements ~~~

Instance scatter(const Setup& s) {
  Instance in;
  const int n = s.size;
  const int64_t part = s.count / n;
  const bool root = s.rank == s.root;
  in.input = placed(s, pattern(s.count, s.rank, s.dtype));
  auto want = pattern(s.count, s.root, s.dtype).narrow(0, s.rank * part, part);
  auto out = placed(s, at::empty({part}, in.input.options()));
  auto group = s.group;
  auto x = in.input;
  c10d::ScatterOptions opts;
  opts.rootRank = s.root;
  in.raw = [=]() {
    std::vector<at::Tensor> o{out};
    std::vector<std::vector<at::Tensor>> i;
    if (root) i.push_back(x.split(part));
    wait(group.transport().scatter(o, i, opts));
  };
  if (root) in.raw_source = x;
  in.check_raw = [=]() {
    out.zero_();
    in.raw();
    return count_wrong(out, want);
  };
  const auto options = ops::ScatterOptions().src(s.root);
  in.op = [options, group](const at::Tensor& x) { return ops::scatter(x, options, group); };
  in.check_op = [want](const at::Tensor& y) { return count_wrong(y, want); };
  in.forward_backward = fwd_bwd(in.input, in.op);
  return in;
}

Instance gather(const Setup& s) {
  Instance in;
  const int n = s.size;
  const int64_t part = s.count / n;
  const bool root = s.rank == s.root;
  in.input = placed(s, pattern(part, s.rank, s.dtype));
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(pattern(part, r, s.dtype));
  auto want = root ? at::cat(parts) : at::zeros({part * n}, s.dtype);
  auto out = placed(s, at::empty({n, part}, in.input.options()));
  auto group = s.group;
  auto x = in.input;
  c10d::GatherOptions opts;
  opts.rootRank = s.root;
  in.raw = [=]() {
    std::vector<std::vector<at::Tensor>> o;
    if (root) {
      o.emplace_back();
      for (int r = 0; r < n; ++r) o[0].push_back(out[r]);
    }
    std::vector<at::Tensor> i{x};
    wait(group.transport().gather(o, i, opts));
  };
  in.raw_source = x;
  in.check_raw = [=]() {
    out.zero_();
    in.raw();
    return root ? count_wrong(out.view({-1}), want) : int64_t{0};
  };
  const auto options = ops::GatherOptions().dst(s.root);
  in.op = [options, group](const at::Tensor& x) { return ops::gather(x, options, group); };
  in.check_op = [want](const at::Tensor& y) { return count_wrong(y, want); };
  in.forward_backward = fwd_bwd(in.input, in.op);
  return in;
}

// ~~~ all_to_all: count = elements per rank ~~~

Instance all_to_all(const Setup& s) {
  Instance in;
  const int n = s.size;
  const int64_t part = s.count / n;
  in.input = placed(s, pattern(s.count, s.rank, s.dtype));
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(pattern(s.count, r, s.dtype).narrow(0, s.rank * part, part));
  auto want = at::cat(parts);
  auto out = placed(s, at::empty({s.count}, in.input.options()));
  auto group = s.group;
  auto x = in.input;
  in.raw = [out, x, group]() {
    std::vector<int64_t> none;
    at::Tensor o = out, i = x;
    wait(group.transport().alltoall_base(o, i, none, none));
  };
  in.raw_source = x;
  in.check_raw = [=]() {
    out.zero_();
    in.raw();
    return count_wrong(out, want);
  };
  in.op = [group](const at::Tensor& x) { return ops::all_to_all(x, {}, group); };
  in.check_op = [want](const at::Tensor& y) { return count_wrong(y, want); };
  in.forward_backward = fwd_bwd(in.input, in.op);
  return in;
}

// ~~~ send/recv: pairs 0->1, 2->3, ...; count = elements per message ~~~

Instance send_recv(const Setup& s) {
  Instance in;
  const bool sender = s.rank % 2 == 0 && s.rank + 1 < s.size;
  const bool receiver = s.rank % 2 == 1;
  in.input = placed(s, pattern(s.count, s.rank, s.dtype));
  auto want = pattern(s.count, s.rank - 1, s.dtype);
  auto buffer = placed(s, at::empty({s.count}, in.input.options()));
  auto group = s.group;
  auto x = in.input;
  const int rank = s.rank;
  in.raw = [=]() {
    if (sender) {
      std::vector<at::Tensor> t{x};
      wait(group.transport().send(t, rank + 1, 0));
    } else if (receiver) {
      std::vector<at::Tensor> t{buffer};
      wait(group.transport().recv(t, rank - 1, 0));
    }
  };
  if (sender) in.raw_source = x;
  in.check_raw = [=]() {
    buffer.zero_();
    in.raw();
    return receiver ? count_wrong(buffer, want) : int64_t{0};
  };
  const int64_t count = s.count;
  const auto dtype = s.dtype;
  in.op = [=](const at::Tensor& x) -> at::Tensor {
    if (sender) return ops::send(x, ops::SendOptions(rank + 1), group);
    if (receiver) {
      return ops::recv({count}, ops::RecvOptions(rank - 1).dtype(dtype).requires_grad(x.requires_grad()), group);
    }
    return at::Tensor();
  };
  in.check_op = [=](const at::Tensor& y) { return receiver ? count_wrong(y, want) : int64_t{0}; };
  if (at::isFloatingType(s.dtype)) {
    auto leaf = x.detach().clone().requires_grad_(true);
    auto grad = at::ones({count}, dtype);
    in.forward_backward = [=]() mutable {
      leaf.mutable_grad() = at::Tensor();
      auto y = in.op(leaf);
      if (sender) y.backward();                              // receives the gradient
      if (receiver) torch::autograd::backward({y}, {grad});  // sends it back
    };
  }
  return in;
}

}  // namespace

int64_t count_wrong(const at::Tensor& got, const at::Tensor& want) {
  if (!got.defined() || got.sizes() != want.sizes()) return want.numel() > 0 ? want.numel() : 1;
  if (at::isFloatingType(want.scalar_type())) {
    auto g = got.to(at::kDouble), w = want.to(at::kDouble);
    return (g - w).abs().gt(w.abs().mul(1e-2).add(1e-6)).sum().item<int64_t>();
  }
  return got.ne(want).sum().item<int64_t>();
}

const std::vector<Collective>& collectives() {
  static const std::vector<Collective> all{
      {"all_reduce", true, false, false, [](int n) { return n > 0 ? 2.0 * (n - 1) / n : 0; }, all_reduce,
       all_reduce_link},
      {"all_gather", false, false, true, all_factor, all_gather, parts_link},
      {"reduce_scatter", true, false, true, all_factor, reduce_scatter, parts_link},
      {"broadcast", false, true, false, [](int) { return 1.0; }, broadcast},
      {"reduce", false, true, false, [](int) { return 1.0; }, reduce},
      {"scatter", false, true, true, all_factor, scatter},
      {"gather", false, true, true, all_factor, gather},
      {"all_to_all", false, false, true, all_factor, all_to_all},
      {"send_recv", false, false, false, [](int) { return 1.0; }, send_recv},
  };
  return all;
}

}  // namespace commgrad::bench
