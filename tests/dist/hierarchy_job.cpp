// A job for hierarchy_test: ranks started by hand with COMMGRAD_HOST set per
// rank, so that one machine holds several "hosts" of any layout. Every rank
// checks the group's transport and the all_reduce of every reduction, dtype
// and a few shapes (including empty and non-contiguous tensors) against
// closed forms, the differentiable all_reduce's gradient, a sub-group inside
// one host (shm) and the data movements that run on the flat Gloo transport,
// all_gather and reduce_scatter (raw, differentiable and as direct transport
// calls, with their gradients) against the same calls on a flat Gloo group of
// the same ranks, then prints "rank r ok (<transport>)".

#include <commgrad/commgrad.h>
#include <commgrad/util/names.h>

#include <ATen/ATen.h>

#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace {

using commgrad::Group;
using commgrad::ReduceOp;
namespace ops = commgrad::ops;

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "rank " << commgrad::rank() << ": " << what << " is wrong\n";
    ++failures;
  }
}

// Small integers that depend on the rank: every sum, product and average
// below is exact in every dtype, so the two groups must agree bit for bit.
at::Tensor pattern(at::IntArrayRef sizes, int rank, int64_t modulus, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  return (at::arange(numel).view(sizes) % modulus + rank + 1).to(dtype);
}

// Raw all_gather and reduce_scatter on `world` equal those on `flat`: odd
// sizes, dims 0 and 1 (a non-contiguous part), uneven parts, every reduction.
void compare_raw(const Group& world, const Group& flat) {
  const int n = world.size(), r = world.rank();
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kInt}) {
    for (int64_t k : {1, 7, 33}) {
      const auto part = pattern({k, 3}, r, 7, dtype);
      for (int64_t dim : {0, 1}) {
        const auto o = ops::AllGatherOptions().dim(dim);
        check(at::equal(ops::raw::all_gather(part, o, world).wait(), ops::raw::all_gather(part, o, flat).wait()),
              "all_gather dim " + std::to_string(dim) + " of " + commgrad::tensor_name(part));
      }
      const auto strided = part.t();  // [3, k], not contiguous
      check(at::equal(ops::raw::all_gather(strided, ops::AllGatherOptions().dim(1), world).wait(),
                      ops::raw::all_gather(strided, ops::AllGatherOptions().dim(1), flat).wait()),
            "all_gather of a transposed " + commgrad::tensor_name(part));
      std::vector<int64_t> sizes;
      for (int q = 0; q < n; ++q) sizes.push_back(k + q % 2);
      const auto uneven = pattern({k + r % 2, 3}, r, 7, dtype);
      const auto uo = ops::AllGatherOptions().sizes(sizes);
      check(at::equal(ops::raw::all_gather(uneven, uo, world).wait(), ops::raw::all_gather(uneven, uo, flat).wait()),
            "uneven all_gather of " + commgrad::tensor_name(uneven));
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProduct}) {
        if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
        if (op == ReduceOp::kProduct && dtype == at::kBFloat16) continue;  // LibTorch 1.13 has no bfloat16 prod
        const auto full = pattern({n * k, 3}, r, op == ReduceOp::kProduct ? 2 : 5, dtype);
        for (const auto& x : {full, full.t()}) {  // dim 0, and dim 1 of a transposed (non-contiguous) input
          const auto o = ops::ReduceScatterOptions().op(op).dim(x.size(0) == 3 ? 1 : 0);
          check(at::equal(ops::raw::reduce_scatter(x, o, world).wait(), ops::raw::reduce_scatter(x, o, flat).wait()),
                std::string("reduce_scatter ") + commgrad::reduce_op_name(op) + " dim " + std::to_string(o.dim()) +
                    " of " + commgrad::tensor_name(x));
        }
      }
      const auto ro = ops::ReduceScatterOptions().sizes(sizes);
      const auto whole = pattern({n * k + n / 2, 3}, r, 5, dtype);
      check(at::equal(ops::raw::reduce_scatter(whole, ro, world).wait(),
                      ops::raw::reduce_scatter(whole, ro, flat).wait()),
            "uneven reduce_scatter of " + commgrad::tensor_name(whole));
    }
  }
}

// f(x, group) on both groups: equal results and equal gradients of a
// rank-dependent weighted sum (Family 1 ops and Family 2 mappings alike).
void compare_grad(const std::string& what, const at::Tensor& x0, const Group& world, const Group& flat,
                  const std::function<at::Tensor(const at::Tensor&, const Group&)>& f) {
  auto a = x0.clone().requires_grad_(true);
  auto b = x0.clone().requires_grad_(true);
  const auto ya = f(a, world);
  const auto yb = f(b, flat);
  const auto w = pattern(ya.sizes(), world.rank(), 3, ya.scalar_type());
  (ya * w).sum().backward();
  (yb * w).sum().backward();
  check(at::equal(ya, yb) && at::equal(a.grad(), b.grad()), what + " and its gradient");
}

void compare_grads(const Group& world, const Group& flat) {
  namespace tp = commgrad::tp;
  const int n = world.size(), r = world.rank();
  const auto part = pattern({5, 2 * n}, r, 7, at::kFloat);
  compare_grad("ops::all_gather", part, world, flat, [](const at::Tensor& x, const Group& g) {
    return ops::all_gather(x, ops::AllGatherOptions().dim(1), g);
  });
  compare_grad("ops::reduce_scatter AVG", part.t(), world, flat, [](const at::Tensor& x, const Group& g) {
    return ops::reduce_scatter(x, ops::ReduceScatterOptions().op(ReduceOp::kAvg), g);
  });
  compare_grad("tp::gather_from_sequence_parallel_region", part, world, flat, tp::gather_from_sequence_parallel_region);
  compare_grad("tp::reduce_scatter_to_sequence_parallel_region", pattern({3 * n, 4}, r, 5, at::kDouble), world, flat,
               tp::reduce_scatter_to_sequence_parallel_region);
  compare_grad("tp::gather_from_tp_region", part, world, flat, tp::gather_from_tp_region);
}

// The hierarchical transport called directly, as c10d users call it: outputs
// that are not back to back, non-contiguous outputs, every reduction, empty
// parts, and a reduction it leaves to the flat transport.
void check_transport_calls(const Group& world) {
  const int n = world.size(), r = world.rank();
  auto& t = world.transport();
  const int64_t c = 5;
  auto in = at::arange(c, at::kDouble) + r * 10;
  std::vector<at::Tensor> rows;
  for (int q = 0; q < n; ++q) rows.push_back(at::arange(c, at::kDouble) + q * 10);
  const auto gathered = at::stack(rows);
  auto strided_out = at::zeros({c, n}, at::kDouble).t();
  t._allgather_base(strided_out, in)->wait();
  check(at::equal(strided_out, gathered), "_allgather_base into a non-contiguous output");
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int q = 0; q < n; ++q) outs[0].push_back(at::zeros({c}, at::kDouble));
  std::vector<at::Tensor> ins{in};
  t.allgather(outs, ins)->wait();
  check(at::equal(at::stack(outs[0]), gathered), "allgather into separate outputs");
  auto empty_in = at::empty({0});
  auto empty_out = at::empty({0});
  t._allgather_base(empty_out, empty_in)->wait();
  t._reduce_scatter_base(empty_out, empty_in)->wait();
  for (auto dtype : {at::kDouble, at::kLong}) {
    for (auto op : {c10d::ReduceOp::SUM, c10d::ReduceOp::AVG, c10d::ReduceOp::MAX, c10d::ReduceOp::MIN,
                    c10d::ReduceOp::PRODUCT}) {
      auto full = [&](int q) { return (at::arange(n * c) % 3 + q + 1).to(dtype); };
      at::Tensor want = full(0);
      for (int q = 1; q < n; ++q) {
        switch (op) {
          case c10d::ReduceOp::MAX:
            want = at::maximum(want, full(q));
            break;
          case c10d::ReduceOp::MIN:
            want = at::minimum(want, full(q));
            break;
          case c10d::ReduceOp::PRODUCT:
            want = want * full(q);
            break;
          default:
            want = want + full(q);
        }
      }
      if (op == c10d::ReduceOp::AVG) want = at::is_floating_point(want) ? want / n : at::div(want, n, "trunc");
      want = want.narrow(0, r * c, c);
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = op;
      const std::string what =
          "reduce_scatter " + std::to_string(static_cast<int>(op)) + " of " + commgrad::tensor_name(full(r));
      auto x = full(r);
      auto out = at::zeros({c, 2}, dtype).select(1, 0);  // not contiguous
      t._reduce_scatter_base(out, x, opts)->wait();
      check(at::equal(out, want) && at::equal(x, full(r)), "_" + what + " into a non-contiguous output");
      std::vector<at::Tensor> one{at::zeros({c}, dtype)};
      std::vector<std::vector<at::Tensor>> parts(1);
      for (int q = 0; q < n; ++q) parts[0].push_back(x.narrow(0, q * c, c).clone());  // not back to back
      t.reduce_scatter(one, parts, opts)->wait();
      check(at::equal(one[0], want), what + " of separate parts");
      parts[0] = x.chunk(n);  // back to back
      t.reduce_scatter(one, parts, opts)->wait();
      check(at::equal(one[0], want), what + " of back-to-back parts");
    }
  }
  // BAND has no hierarchical form: it goes to the flat Gloo transport, which
  // computes it (LibTorch 2.x) or says it does not support it (1.13).
  c10d::ReduceScatterOptions band;
  band.reduceOp = c10d::ReduceOp::BAND;
  std::vector<at::Tensor> band_out{at::zeros({1}, at::kLong)};
  std::vector<std::vector<at::Tensor>> band_in(1);
  for (int q = 0; q < n; ++q) band_in[0].push_back(at::full({1}, q == r ? 6 : 3, at::kLong));
  try {
    t.reduce_scatter(band_out, band_in, band)->wait();
    check(band_out[0].item<int64_t>() == (n > 1 ? 2 : 6), "reduce_scatter BAND on the flat transport");
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    check(message.find("does not support") != std::string::npos, "reduce_scatter BAND's error: " + message);
  }
  check(at::equal(ops::raw::all_gather(at::full({1}, r)).wait(), at::arange(n)), "all_gather after BAND");
}

}  // namespace

int main() {
  auto world = commgrad::init_process_group();
  const int n = world.size();
  const int r = world.rank();
  const bool spans_hosts = !world.single_host();

  // The reductions, each with its closed form over ranks 0..n-1 of (rank + 1) * base.
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kBFloat16}) {
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
      const auto base = (at::arange(numel) % 5 + 1).to(dtype);
      const auto mine = base * (r + 1);
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProduct, ReduceOp::kAvg}) {
        if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
        if (op == ReduceOp::kProduct && n > 3) continue;  // keep products exact in bfloat16
        at::Tensor want;
        switch (op) {
          case ReduceOp::kSum:
            want = base * (n * (n + 1) / 2);
            break;
          case ReduceOp::kAvg:
            want = base * ((n + 1) / 2.0);
            break;
          case ReduceOp::kMax:
            want = base * n;
            break;
          case ReduceOp::kMin:
            want = base.clone();
            break;
          case ReduceOp::kProduct: {
            int64_t f = 1;
            for (int q = 1; q <= n; ++q) f *= q;
            want = base.pow(n) * f;
            break;
          }
        }
        const auto got = ops::raw::all_reduce(mine, ops::AllReduceOptions().op(op)).wait();
        check(at::allclose(got.to(at::kDouble), want.to(at::kDouble), 1e-2, 1e-6),
              std::string("all_reduce ") + commgrad::reduce_op_name(op) + " of " + commgrad::tensor_name(mine));
      }
    }
  }
  // Non-contiguous input, in-place form, and the gradient (Family 1: x.grad = n).
  const auto wide = at::ones({6, 4}) * (r + 1);
  const auto strided = wide.t();
  check(at::equal(ops::raw::all_reduce(strided).wait(), at::ones({4, 6}) * (n * (n + 1) / 2)), "strided all_reduce");
  auto inplace = at::full({5}, r + 1.0);
  ops::raw::all_reduce_(inplace).wait();
  check(at::equal(inplace, at::full({5}, n * (n + 1) / 2.0)), "all_reduce_");
  auto x = at::ones({4}).requires_grad_(true);
  ops::all_reduce(x).backward(at::ones({4}));
  check(at::equal(x.grad(), at::full({4}, static_cast<float>(n))), "x.grad");
  // Several in flight, waited in reverse order.
  std::vector<ops::raw::Pending> pending;
  for (int i = 0; i < 4; ++i) pending.push_back(ops::raw::all_reduce(at::full({3}, (r + 1.0) * (i + 1))));
  for (int i = 3; i >= 0; --i) {
    check(at::equal(pending[i].wait(), at::full({3}, n * (n + 1) / 2.0 * (i + 1))),
          "async all_reduce " + std::to_string(i));
  }
  // Data movements (flat Gloo).
  const auto gathered = ops::raw::all_gather(at::full({2}, static_cast<float>(r))).wait();
  check(at::equal(gathered, at::arange(n).to(at::kFloat).repeat_interleave(2)), "all_gather");
  check(at::equal(ops::raw::broadcast(at::full({3}, r + 7.0), ops::BroadcastOptions().src(n - 1)).wait(),
                  at::full({3}, n - 1 + 7.0)),
        "broadcast");
  ops::barrier();
  // all_gather and reduce_scatter against a flat Gloo group of every rank.
  std::vector<int> everyone(n);
  for (int q = 0; q < n; ++q) everyone[q] = q;
  const auto flat = commgrad::new_group(everyone, commgrad::NewGroupOptions().backend("gloo").name("flat"));
  compare_raw(world, flat);
  compare_grads(world, flat);
  if (world.backend_name() == "hierarchical") check_transport_calls(world);
  // A sub-group of the ranks on this host: shm when it has more than one member.
  std::vector<std::vector<int>> by_host;
  std::vector<std::string> seen;
  for (int q = 0; q < n; ++q) {
    const auto& h = world.state()->hosts[q];
    auto it = std::find(seen.begin(), seen.end(), h);
    if (it == seen.end()) {
      seen.push_back(h);
      by_host.push_back({q});
    } else {
      by_host[it - seen.begin()].push_back(q);
    }
  }
  for (size_t h = 0; h < by_host.size(); ++h) {
    auto local = commgrad::new_group(by_host[h], commgrad::NewGroupOptions().name("host" + std::to_string(h)));
    if (!local.is_member()) continue;
    check(local.backend_name() == "shm", "backend of group " + local.describe());
    const auto sum = ops::all_reduce(at::ones({2}), {}, local);
    check(at::equal(sum, at::full({2}, static_cast<float>(local.size()))), "all_reduce on " + local.describe());
  }
  // TP inside a host, DP across hosts (equal hosts of consecutive ranks): the TP group stays on shm.
  bool equal_hosts = by_host.size() > 1;
  for (const auto& h : by_host) {
    equal_hosts = equal_hosts && h.size() == by_host.front().size() && h.size() > 1 &&
                  h.back() - h.front() + 1 == static_cast<int>(h.size());  // consecutive ranks
  }
  if (equal_hosts) {
    auto state = commgrad::make_model_parallel(static_cast<int>(by_host.front().size()));
    check(state.tensor_parallel_group().backend_name() == "shm", "TP group transport in " + state.describe());
    check(state.data_parallel_group().backend_name() == "gloo", "DP group transport in " + state.describe());
    const auto dp_sum = ops::all_reduce(at::ones({2}), {}, state.data_parallel_group());
    check(at::equal(dp_sum, at::full({2}, static_cast<float>(by_host.size()))), "DP all_reduce");
    if (r == 0) std::cout << "parallel state: " << state.describe() << std::endl;
  }
  if (failures > 0) return 1;
  std::cout << "rank " << r << " ok (" << world.backend_name() << (spans_hosts ? ", spans hosts" : "") << ")"
            << std::endl;
  commgrad::destroy_process_group();
  return 0;
}
