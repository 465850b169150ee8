// A job for hierarchy_test: ranks started by hand with COMMGRAD_HOST set per
// rank, so that one machine holds several "hosts" of any layout. Every rank
// checks the group's transport and the all_reduce of every reduction, dtype
// and a few shapes (including empty and non-contiguous tensors) against
// closed forms, the differentiable all_reduce's gradient, a sub-group inside
// one host (shm) and the data movements that run on the flat Gloo transport,
// then prints "rank r ok (<transport>)".

#include <commgrad/commgrad.h>
#include <commgrad/util/names.h>

#include <ATen/ATen.h>

#include <iostream>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "rank " << commgrad::rank() << ": " << what << " is wrong\n";
    ++failures;
  }
}

}  // namespace

int main() {
  using commgrad::ReduceOp;
  namespace ops = commgrad::ops;
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
          case ReduceOp::kSum: want = base * (n * (n + 1) / 2); break;
          case ReduceOp::kAvg: want = base * ((n + 1) / 2.0); break;
          case ReduceOp::kMax: want = base * n; break;
          case ReduceOp::kMin: want = base.clone(); break;
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
    check(at::equal(pending[i].wait(), at::full({3}, n * (n + 1) / 2.0 * (i + 1))), "async all_reduce " + std::to_string(i));
  }
  // Data movements (flat Gloo).
  const auto gathered = ops::raw::all_gather(at::full({2}, static_cast<float>(r))).wait();
  check(at::equal(gathered, at::arange(n).to(at::kFloat).repeat_interleave(2)), "all_gather");
  check(at::equal(ops::raw::broadcast(at::full({3}, r + 7.0), ops::BroadcastOptions().src(n - 1)).wait(),
                  at::full({3}, n - 1 + 7.0)),
        "broadcast");
  ops::barrier();
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
  // TP inside a host, DP across hosts (equal hosts): the TP group stays on shm.
  bool equal_hosts = by_host.size() > 1;
  for (const auto& h : by_host) equal_hosts = equal_hosts && h.size() == by_host.front().size() && h.size() > 1;
  if (equal_hosts) {
    auto state = commgrad::tp::make_model_parallel(static_cast<int>(by_host.front().size()));
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
