// DynamicLossScaler (the rule is in the header).
//
// What a step costs: one pass over the gradients that unscales them (a
// float32 temporary for each 16-bit gradient, so that 1/S, often far below
// float16's range, is applied exactly), one isfinite reduction per gradient
// on the unscaled values that the optimizer will read, one device-to-host
// copy of the local flag, and one float32 MAX all-reduce of that flag per
// group of more than one rank. The flag travels on the CPU transport of
// every group whatever device the gradients are on, so ranks whose
// gradients live elsewhere (or a rank without gradients) still call the
// same collective; the caller needs the answer on the host anyway, to
// decide whether to step.

#include "commgrad/optim/loss_scaler.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <iterator>

namespace commgrad::optim {
namespace {

constexpr const char* kLossScalerOp = "DynamicLossScaler";

void check_options(const DynamicLossScalerOptions& o) {
  TORCH_CHECK(o.initial_scale() > 0 && std::isfinite(o.initial_scale()),
              "[commgrad] DynamicLossScaler: initial_scale must be positive and finite, got ", o.initial_scale());
  TORCH_CHECK(o.min_scale() > 0 && o.min_scale() <= o.initial_scale(),
              "[commgrad] DynamicLossScaler: min_scale must be positive and at most initial_scale (", o.initial_scale(),
              "), got ", o.min_scale());
  TORCH_CHECK(o.growth_factor() > 1 && std::isfinite(o.growth_factor()),
              "[commgrad] DynamicLossScaler: growth_factor must be above 1 (and finite), got ", o.growth_factor());
  TORCH_CHECK(o.backoff_factor() > 0 && o.backoff_factor() < 1,
              "[commgrad] DynamicLossScaler: backoff_factor must be in (0, 1), got ", o.backoff_factor());
  TORCH_CHECK(o.growth_interval() >= 1, "[commgrad] DynamicLossScaler: growth_interval must be at least 1, got ",
              o.growth_interval());
  TORCH_CHECK(o.hysteresis() >= 1, "[commgrad] DynamicLossScaler: hysteresis must be at least 1, got ", o.hysteresis());
}

// The groups given (undefined ones dropped), or the current layout's.
std::vector<Group> resolve_groups(const std::vector<Group>& requested) {
  std::vector<Group> groups;
  if (requested.empty()) {
    groups.push_back(default_data_parallel_group());
    for (const Group& g : {default_tensor_parallel_group(), default_pipeline_parallel_group()}) {
      if (g.defined()) groups.push_back(g);
    }
  } else {
    std::copy_if(requested.begin(), requested.end(), std::back_inserter(groups),
                 [](const Group& g) { return g.defined(); });
  }
  for (const auto& g : groups) check_member(kLossScalerOp, g);
  return groups;
}

bool is_16_bit(const at::Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }

// Every entry must be a single number (0-d or one element).
int64_t state_integer(const torch::OrderedDict<std::string, at::Tensor>& state, const std::string& key) {
  const at::Tensor* t = state.find(key);
  TORCH_CHECK(t != nullptr && t->defined(), "[commgrad] DynamicLossScaler::load_state_dict: no '", key, "' entry");
  TORCH_CHECK(t->numel() == 1, "[commgrad] DynamicLossScaler::load_state_dict: '", key, "' must hold one number, got ",
              tensor_name(*t));
  return t->item<int64_t>();
}

}  // namespace

DynamicLossScaler::DynamicLossScaler(DynamicLossScalerOptions options)
    : options_(std::move(options)), scale_(options_.initial_scale()), hysteresis_tracker_(options_.hysteresis()) {
  check_options(options_);
  groups_ = resolve_groups(options_.groups());
}

at::Tensor DynamicLossScaler::scale(const at::Tensor& loss) const {
  TORCH_CHECK(loss.defined(), "[commgrad] DynamicLossScaler::scale: the loss is an undefined tensor");
  TORCH_CHECK(loss.is_floating_point(), "[commgrad] DynamicLossScaler::scale: the loss must be floating point, got ",
              tensor_name(loss));
  return loss * scale_;
}

at::Tensor DynamicLossScaler::unscale_locally(const std::vector<at::Tensor>& grads) const {
  at::NoGradGuard no_grad;
  // Megatron's inv_scale: 1/S computed in float64, applied as float32.
  const auto inv_scale = static_cast<float>(1.0 / scale_);
  at::Tensor all_finite;  // a bool on the first gradient's device: one host sync in all
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    TORCH_CHECK(g.is_floating_point(), "[commgrad] DynamicLossScaler::unscale_and_check: gradient ", i,
                " must be floating point, got ", tensor_name(g));
    if (is_16_bit(g)) {
      g.copy_(g.to(at::kFloat).mul_(inv_scale));
    } else {
      g.mul_(inv_scale);
    }
    at::Tensor finite = at::isfinite(g).all();
    all_finite = all_finite.defined() ? all_finite.logical_and(finite.to(all_finite.device())) : finite;
  }
  auto found = at::zeros({1}, at::kFloat);
  if (all_finite.defined()) found.copy_(at::logical_not(all_finite).reshape({1}));
  return found;
}

bool DynamicLossScaler::unscale_and_check(const std::vector<at::Tensor>& grads) {
  at::Tensor found = unscale_locally(grads);
  for (const auto& g : groups_) {
    if (g.size() > 1) ops::raw::all_reduce_(found, ops::AllReduceOptions().op(ReduceOp::kMax), g).wait();
  }
  return found.item<float>() > 0;
}

void DynamicLossScaler::update(bool found_inf) {
  if (found_inf) {
    ++skipped_steps_;
    growth_tracker_ = 0;
    if (--hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * options_.backoff_factor(), options_.min_scale());
    return;
  }
  if (++growth_tracker_ == options_.growth_interval()) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = options_.hysteresis();
    scale_ *= options_.growth_factor();
  }
}

bool DynamicLossScaler::step(const std::vector<at::Tensor>& grads, const std::function<void()>& optimizer_step) {
  TORCH_CHECK(optimizer_step, "[commgrad] DynamicLossScaler::step: the optimizer step is empty");
  const bool found_inf = unscale_and_check(grads);
  if (!found_inf) optimizer_step();
  update(found_inf);
  return !found_inf;
}

bool DynamicLossScaler::step(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) grads.push_back(p.grad());
  }
  return step(grads, [&optimizer] { optimizer.step(); });
}

torch::OrderedDict<std::string, at::Tensor> DynamicLossScaler::state_dict() const {
  torch::OrderedDict<std::string, at::Tensor> state;
  state.insert("scale", at::scalar_tensor(scale_, at::kDouble));
  state.insert("growth_tracker", at::scalar_tensor(growth_tracker_, at::kLong));
  state.insert("hysteresis_tracker", at::scalar_tensor(hysteresis_tracker_, at::kLong));
  state.insert("skipped_steps", at::scalar_tensor(skipped_steps_, at::kLong));
  return state;
}

void DynamicLossScaler::load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state) {
  const at::Tensor* scale = state.find("scale");
  TORCH_CHECK(scale != nullptr && scale->defined() && scale->numel() == 1,
              "[commgrad] DynamicLossScaler::load_state_dict: no 'scale' entry holding one number");
  const double s = scale->item<double>();
  TORCH_CHECK(s > 0 && std::isfinite(s),
              "[commgrad] DynamicLossScaler::load_state_dict: 'scale' must be positive "
              "and finite, got ",
              s);
  const int64_t growth = state_integer(state, "growth_tracker");
  const int64_t hysteresis = state_integer(state, "hysteresis_tracker");
  const int64_t skipped = state_integer(state, "skipped_steps");
  TORCH_CHECK(growth >= 0 && skipped >= 0, "[commgrad] DynamicLossScaler::load_state_dict: 'growth_tracker' (", growth,
              ") and 'skipped_steps' (", skipped, ") must not be negative");
  scale_ = s;
  growth_tracker_ = growth;
  hysteresis_tracker_ = hysteresis;
  skipped_steps_ = skipped;
}

}  // namespace commgrad::optim
