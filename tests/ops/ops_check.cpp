// A small program run by the tests through commgrad-run at 2 and 3 ranks:
// every rank runs a few differentiable collectives with rank-dependent
// inputs, checks values and gradients in closed form, and exits non-zero on
// a mismatch. With --mismatch [N0 N1], rank 0 all-reduces N0 elements and
// the others N1 (default 3 and 4), to show how a mismatch ends the job.
// With --uncaught-error every rank all-reduces, then throws a shape error
// that nothing catches (the terminate handler must not blame the collective).

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <cstdlib>
#include <cstring>
#include <iostream>

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::cerr << "rank " << commgrad::rank() << ": check failed: " << what << "\n";
    ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  namespace ops = commgrad::ops;
  if (argc > 1 && std::strcmp(argv[1], "--uncaught-error") == 0) {
    commgrad::init_process_group();
    ops::all_reduce(torch::ones({3}));
    // An error that has nothing to do with communication, thrown out of main.
    torch::matmul(torch::ones({2, 3}), torch::ones({2, 3}));
    return 0;
  }
  try {
    commgrad::init_process_group();
    const int n = commgrad::world_size();
    const int r = commgrad::rank();
    if (argc > 1 && std::strcmp(argv[1], "--mismatch") == 0) {
      const int64_t mine = argc > 3 ? std::atoll(argv[r == 0 ? 2 : 3]) : (r == 0 ? 3 : 4);
      ops::all_reduce(torch::ones({mine}));
      return 0;
    }
    // all_reduce: x_r = r + 1; y = n(n+1)/2; grad = n (sum of per-rank ones).
    auto x = torch::full({3}, r + 1.0, torch::kDouble).requires_grad_(true);
    auto y = ops::all_reduce(x);
    y.sum().backward();
    check(torch::equal(y.detach(), torch::full({3}, n * (n + 1) / 2.0, torch::kDouble)), "all_reduce value");
    check(torch::equal(x.grad(), torch::full({3}, static_cast<double>(n), torch::kDouble)), "all_reduce grad");

    // all_gather then reduce_scatter: (w_r * gather(x)).sum() per rank.
    auto a = torch::full({2, 2}, static_cast<double>(r), torch::kDouble).requires_grad_(true);
    auto g = ops::all_gather(a, ops::AllGatherOptions().dim(1));
    check(g.size(1) == 2 * n && g[0][2 * (n - 1)].item<double>() == n - 1, "all_gather value");
    (g * (r + 1)).sum().backward();
    check(torch::equal(a.grad(), torch::full({2, 2}, n * (n + 1) / 2.0, torch::kDouble)), "all_gather grad");
    auto s = ops::reduce_scatter(torch::ones({2 * n}, torch::kDouble));
    check(torch::equal(s, torch::full({2}, static_cast<double>(n), torch::kDouble)), "reduce_scatter value");

    // broadcast from the last rank, and all_to_all.
    auto b = ops::broadcast(torch::full({2}, static_cast<float>(r)), ops::BroadcastOptions().src(n - 1));
    check(torch::equal(b, torch::full({2}, static_cast<float>(n - 1))), "broadcast value");
    auto t = ops::all_to_all(torch::arange(n, torch::kLong).add(r * n));
    check(torch::equal(t, torch::arange(n, torch::kLong).mul(n).add(r)), "all_to_all value");
    ops::barrier();
    commgrad::destroy_process_group();
    if (failures == 0 && r == 0) std::cout << "ops_check: all checks passed on " << n << " ranks\n";
  } catch (const c10::Error& e) {
    std::cerr << "ops_check: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ops_check: " << e.what() << "\n";
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
