// The debug check that TP-replicated parameters stay equal (see the header).

#include "commgrad/tp/replica_check.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/debug.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/tp/wiring_checks.h"

#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace commgrad::tp {
namespace {

// Two exact integer checksums of a tensor's bytes: their sum, and their sum
// weighted by position (so that equal bytes in another order differ too).
// Integers, so equal bytes give equal sums whatever the summation order.
std::pair<int64_t, int64_t> checksums(const at::Tensor& t) {
  const at::Tensor bytes = t.detach().contiguous().view(-1).view(at::kByte).to(at::kLong);
  const at::Tensor weights = at::arange(bytes.numel(), bytes.options()).remainder(65521).add_(1);
  return {bytes.sum().item<int64_t>(), bytes.mul(weights).sum().item<int64_t>()};
}

}  // namespace

void check_replicated_parameters(const torch::nn::Module& module, const char* op) {
  const Group tp = partitioned_parameters_group(module, op);
  if (!tp.defined() || tp.size() == 1 || !tp.is_member()) return;
  const auto params = module.named_parameters();
  const auto specs = shard_specs(module);
  std::vector<std::string> names;
  std::vector<int64_t> sums;
  for (const auto& item : params) {
    if (specs[item.key()].spec.is_partitioned()) continue;
    const auto [plain, weighted] = checksums(item.value());
    names.push_back(item.key());
    sums.push_back(plain);
    sums.push_back(weighted);
  }
  if (names.empty()) return;
  const at::Tensor mine = at::tensor(sums, at::kLong);
  const at::Tensor all = ops::raw::all_gather(mine, {}, tp).wait().view({tp.size(), -1});
  for (int64_t r = 0; r < tp.size(); ++r) {
    const at::Tensor differs = all[r].ne(all[0]).view({-1, 2}).any(1);
    if (!differs.any().item<bool>()) continue;
    const int64_t index = differs.nonzero()[0][0].item<int64_t>();
    COMMGRAD_CHECK_AS(ErrorKind::kMismatch, false, op, tp, "the replicated parameter '", names[index],
                      "' differs between tensor-parallel ranks ", tp.ranks()[0], " and ", tp.ranks()[r], " (group '",
                      tp.name(),
                      "'): TP ranks stepped differently (a gradient norm or clipping "
                      "without the TP group, or a replicated gradient not reduced over it)");
  }
}

void debug_check_replicated_parameters(const torch::nn::Module& module, const char* op) {
  if (ops::debug_checks()) check_replicated_parameters(module, op);
}

}  // namespace commgrad::tp
