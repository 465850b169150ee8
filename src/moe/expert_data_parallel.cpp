// Expert and dense parameters: names, the two wrappers' options, and the
// global norm that counts every expert once (expert_data_parallel.h).
//
// An expert parameter is one that a moe::Experts module owns: the property
// is stated where the parameter is made (the Experts module) and read here
// by walking the module tree, so no naming convention is involved.

#include "commgrad/moe/expert_data_parallel.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/moe/experts.h"
#include "commgrad/ops/raw.h"
#include "commgrad/optim/clip_grad.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace commgrad::moe {
namespace {

std::unordered_set<const c10::TensorImpl*> expert_tensors(const torch::nn::Module& module) {
  std::unordered_set<const c10::TensorImpl*> out;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (dynamic_cast<const ExpertsImpl*>(m.get()) == nullptr) continue;
    for (const auto& p : m->parameters()) out.insert(p.unsafeGetTensorImpl());
  }
  return out;
}

std::vector<std::string> names_where(const torch::nn::Module& module, bool expert) {
  const auto experts = expert_tensors(module);
  std::vector<std::string> out;
  for (const auto& item : module.named_parameters()) {
    if (experts.count(item.value().unsafeGetTensorImpl()) == (expert ? 1U : 0U)) out.push_back(item.key());
  }
  return out;
}

}  // namespace

std::vector<std::string> expert_parameter_names(const torch::nn::Module& module) { return names_where(module, true); }

std::vector<std::string> dense_parameter_names(const torch::nn::Module& module) { return names_where(module, false); }

dp::DistributedDataParallelOptions dense_ddp_options(const torch::nn::Module& module, const Group& data_group,
                                                     dp::DistributedDataParallelOptions base) {
  auto ignored = base.ignored_parameters();
  for (auto& name : expert_parameter_names(module)) ignored.push_back(std::move(name));
  return base.group(data_group).ignored_parameters(std::move(ignored));
}

dp::DistributedDataParallelOptions expert_ddp_options(const torch::nn::Module& module, const Group& data_group,
                                                      const Group& expert_data_group,
                                                      dp::DistributedDataParallelOptions base) {
  const char* op = "moe::expert_ddp_options";
  check_member(op, data_group);
  check_member(op, expert_data_group);
  COMMGRAD_CHECK(data_group.size() % expert_data_group.size() == 0, op, expert_data_group,
                 "the expert-data group must divide the data group (size ", data_group.size(), ")");
  auto ignored = base.ignored_parameters();
  for (auto& name : dense_parameter_names(module)) ignored.push_back(std::move(name));
  return base.group(expert_data_group)
      .ignored_parameters(std::move(ignored))
      .average_divisor(data_group.size())
      .broadcast_buffers(false);
}

std::vector<fsdp::FullyShardedModule> fully_shard_experts(const torch::nn::Module& module,
                                                          fsdp::FullyShardOptions options,
                                                          const Group& expert_data_group) {
  const char* op = "moe::fully_shard_experts";
  const Group data = options.group().defined() ? options.group() : default_data_parallel_group();
  check_member(op, data);
  check_member(op, expert_data_group);
  COMMGRAD_CHECK(data.size() % expert_data_group.size() == 0, op, expert_data_group,
                 "the expert-data group must divide the data group (size ", data.size(), ")");
  COMMGRAD_CHECK(!options.replicate_group().defined() || options.replicate_group().size() == 1, op, expert_data_group,
                 "experts are not sharded with a replicate_group (HSDP): shard them over the "
                 "expert-data group alone");
  options.group(expert_data_group).average_divisor(data.size());
  std::vector<fsdp::FullyShardedModule> out;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (dynamic_cast<const ExpertsImpl*>(m.get()) != nullptr) out.push_back(fsdp::fully_shard(m, options));
  }
  return out;
}

double clip_grad_norm_(const torch::nn::Module& module, double max_norm, const Group& expert_parallel_group) {
  const auto experts = expert_tensors(module);
  double dense = 0, expert = 0;
  std::vector<at::Tensor> grads;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters()) {
    if (!p.grad().defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    (experts.count(p.unsafeGetTensorImpl()) ? expert : dense) += optim::squared_norm(p.grad());
    grads.push_back(p.grad());
  }
  auto total = at::full({1}, expert, at::kDouble);
  if (expert_parallel_group.size() > 1) total = ops::raw::all_reduce(total, {}, expert_parallel_group).wait();
  const double norm = std::sqrt(dense + total.item<double>());
  if (max_norm > 0) {
    const float coef = optim::clip_coefficient(norm, max_norm);
    if (coef < 1.0f) {
      at::NoGradGuard no_grad;
      for (auto& g : grads) g.mul_(coef);
    }
  }
  return norm;
}

}  // namespace commgrad::moe
