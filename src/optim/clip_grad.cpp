// Global-norm gradient clipping (see the header for why float64).

#include "commgrad/optim/clip_grad.h"

#include "commgrad/dist/parallel_state.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/tp/wiring_checks.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cmath>

namespace commgrad::optim {

double squared_norm(const at::Tensor& t) {
  if (t.numel() == 0) return 0.0;
  return t.detach().to(at::kDouble).square().sum().item<double>();
}

float clip_coefficient(double total_norm, double max_norm) {
  const float norm = static_cast<float>(total_norm);
  const float coef = static_cast<float>(max_norm) / (norm + 1e-6f);
  return coef < 1.0f ? coef : 1.0f;
}

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm) {
  TORCH_CHECK(max_norm > 0, "[commgrad] clip_grad_norm_: max_norm must be positive, got ", max_norm);
  at::NoGradGuard no_grad;
  double sum = 0;
  for (const auto& p : parameters) {
    if (p.grad().defined()) sum += squared_norm(p.grad());
  }
  const double norm = std::sqrt(sum);
  const float coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0f) {
    for (const auto& p : parameters) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return norm;
}

double clip_grad_norm_(const torch::nn::Module& module, double max_norm, const Group& tensor_parallel,
                       const Group& pipeline_parallel) {
  constexpr const char* kOp = "clip_grad_norm_";
  TORCH_CHECK(max_norm > 0, "[commgrad] clip_grad_norm_: max_norm must be positive, got ", max_norm);
  const Group tp_group = tp::tensor_parallel_group_for_norm(
      module, tensor_parallel.defined() ? tensor_parallel : default_tensor_parallel_group(), kOp);
  const Group pp_group = pipeline_parallel.defined() ? pipeline_parallel : default_pipeline_parallel_group();
  const bool tp = tp_group.defined() && tp_group.size() > 1;
  const auto specs = tp::shard_specs(module);
  at::NoGradGuard no_grad;
  double replicated = 0, partitioned = 0;
  for (const auto& item : module.named_parameters()) {
    const auto& g = item.value().grad();
    if (!g.defined()) continue;
    (tp && specs[item.key()].spec.is_partitioned() ? partitioned : replicated) += squared_norm(g);
  }
  if (tp) {
    partitioned = ops::raw::all_reduce(at::full({1}, partitioned, at::kDouble), {}, tp_group).wait().item<double>();
  }
  double total = replicated + partitioned;
  if (pp_group.defined() && pp_group.size() > 1) {
    total = ops::raw::all_reduce(at::full({1}, total, at::kDouble), {}, pp_group).wait().item<double>();
  }
  const double norm = std::sqrt(total);
  const float coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0f) {
    for (const auto& p : module.parameters()) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return norm;
}

}  // namespace commgrad::optim
