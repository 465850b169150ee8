#pragma once
// Reading and writing the per-parameter state of torch::optim optimizers
// (Adam's exp_avg, SGD's momentum_buffer, ...) by name, so that state can be
// sharded, gathered, saved and loaded without knowing the optimizer type.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
class OptimizerParamState;
}  // namespace torch::optim

namespace commgrad::optim {

/// One parameter's optimizer state: its per-element tensors (each shaped
/// like the parameter) by name, and its step count where it keeps one.
///
/// Example:
///   auto state = optim::get_param_state(adam, weight);   // exp_avg, exp_avg_sq; step 10
///   for (auto& [name, t] : state->tensors) std::cout << name << " " << t.sizes() << "\n";
struct ParamState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::optional<int64_t> step;
};

/// The state `optimizer` holds for `param` (shared tensors, not copies), or
/// nullopt before its first step. Supports Adam, AdamW, SGD, Adagrad and
/// RMSprop; errors name any other optimizer type.
std::optional<ParamState> get_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param);

/// Replaces the state `optimizer` holds for `param` with copies of `state`'s
/// tensors (creating the state where there is none yet). Errors on a tensor
/// name the optimizer does not keep or a shape that differs from `param`.
void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param, const ParamState& state);

/// Names of the per-element state tensors `optimizer` keeps for a parameter
/// (e.g. {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"} for Adam; those not in use stay undefined).
std::vector<std::string> param_state_names(torch::optim::Optimizer& optimizer);

}  // namespace commgrad::optim
