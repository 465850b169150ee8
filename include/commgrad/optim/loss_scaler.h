#pragma once
// DynamicLossScaler: dynamic loss scaling for float16 training, with
// Megatron-core's DynamicGradScaler rule (megatron/core/optimizer/
// grad_scaler.py) and one agreement on inf/NaN over every group that holds
// gradients.
//
// float16 gradients underflow: values below 2^-24 become zero. The loss is
// multiplied by a scale S before backward, so every gradient is S times
// larger; before the optimizer step the gradients are divided by S again
// (in float32 for 16-bit gradients) and checked for inf/NaN. A step whose
// gradients overflowed on any rank is skipped on every rank. The scale
// adapts:
//   - an inf/NaN step resets the growth tracker and decrements the
//     hysteresis tracker; when that reaches 0 (or below) the scale becomes
//     max(S * backoff_factor, min_scale), and every further inf/NaN step
//     backs off again until the scale has grown once;
//   - a finite step increments the growth tracker; after growth_interval
//     consecutive finite steps the scale becomes S * growth_factor and both
//     trackers are reset (growth 0, hysteresis back to `hysteresis`).
// With the defaults (2^32, x2 / x0.5, 1000, hysteresis 2) the first steps
// overflow and halve the scale until the gradients fit.

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace commgrad::optim {

/// Options of DynamicLossScaler (Megatron's defaults).
///
/// Example:
///   commgrad::optim::DynamicLossScalerOptions().initial_scale(65536).hysteresis(1)
///       .groups({state.data_parallel_group(), state.tensor_parallel_group()})
struct DynamicLossScalerOptions {
  /// The first scale (2^32). Positive and finite.
  TORCH_ARG(double, initial_scale) = 4294967296.0;
  /// The scale never backs off below this (positive, at most initial_scale).
  TORCH_ARG(double, min_scale) = 1.0;
  /// The scale is multiplied by this after growth_interval finite steps (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// ... and by this when it backs off (in (0, 1)).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Consecutive finite steps before the scale grows (>= 1).
  TORCH_ARG(int64_t, growth_interval) = 1000;
  /// Inf/NaN steps (since the last growth) before the scale backs off (>= 1).
  TORCH_ARG(int64_t, hysteresis) = 2;
  /// The groups over which the ranks agree on inf/NaN: every group that
  /// holds gradients (data-, tensor-, pipeline-parallel, embedding), reduced
  /// over in this order, the same on every rank. An undefined group is
  /// skipped (embedding_group() on a middle pipeline stage); a group of one
  /// rank costs nothing. Empty: the current layout's data-parallel group
  /// (the world without a layout) and its tensor- and pipeline-parallel
  /// groups when they have more than one rank.
  TORCH_ARG(std::vector<Group>, groups);
};

/// Dynamic loss scaling of one model's gradients; every rank holds the same
/// state.
///
/// Example:
///   commgrad::optim::DynamicLossScaler scaler;      // Megatron's defaults, the layout's groups
///   for (auto& [x, y] : batches) {
///     opt.zero_grad();
///     scaler.scale(torch::mse_loss(model->forward(x), y)).backward();
///     ...                                            // reduce the gradients (DDP)
///     bool stepped = scaler.step(opt);               // unscale, agree, step unless inf/NaN, update
///   }
class DynamicLossScaler {
 public:
  /// Validates the options and resolves the groups (collective-free).
  explicit DynamicLossScaler(DynamicLossScalerOptions options = {});

  /// loss * scale(), in the loss's dtype (call backward() on it).
  at::Tensor scale(const at::Tensor& loss) const;
  /// The current scale.
  double scale() const { return scale_; }

  /// Divides every defined gradient in `grads` in place by scale() (in
  /// float32 for float16/bfloat16 gradients), then checks them for inf/NaN
  /// and agrees with the other ranks: one float32 MAX all-reduce per group
  /// of groups(). Returns true when any rank of any group found inf/NaN
  /// (the same on every rank). Collective over groups(). Does not update().
  bool unscale_and_check(const std::vector<at::Tensor>& grads);
  /// Applies the rule (see the top of this header) for one step whose
  /// gradients were finite (found_inf false) or not; an inf/NaN step counts
  /// as skipped.
  void update(bool found_inf);

  /// unscale_and_check(grads); calls optimizer_step() unless inf/NaN was
  /// found on some rank; update(). Returns whether it stepped (the same on
  /// every rank). A skipped step leaves the gradients as they are (unscaled,
  /// with the inf/NaN): zero them before the next backward.
  bool step(const std::vector<at::Tensor>& grads, const std::function<void()>& optimizer_step);
  /// step() with the gradients of `optimizer`'s parameters and its step().
  bool step(torch::optim::Optimizer& optimizer);

  /// Finite steps since the last growth or inf/NaN step.
  int64_t growth_tracker() const { return growth_tracker_; }
  /// Inf/NaN steps left before a back-off (0 or below: every inf/NaN step
  /// backs off, until the next growth).
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  /// Inf/NaN (skipped) steps in total.
  int64_t skipped_steps() const { return skipped_steps_; }

  /// The groups the ranks agree over (resolved; undefined ones dropped).
  const std::vector<Group>& groups() const { return groups_; }
  const DynamicLossScalerOptions& options() const { return options_; }

  /// "scale" (float64), "growth_tracker", "hysteresis_tracker",
  /// "skipped_steps" (int64): 0-d CPU tensors (new ones on every call).
  torch::OrderedDict<std::string, at::Tensor> state_dict() const;
  /// Restores what state_dict() returned. Errors naming the entry when one
  /// is missing, not a single number, or out of range.
  void load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state);

 private:
  // Unscales `grads` in place; returns this rank's flag (float32 [1] on
  // the CPU: 1 when some gradient is not finite after unscaling).
  at::Tensor unscale_locally(const std::vector<at::Tensor>& grads) const;

  DynamicLossScalerOptions options_;
  std::vector<Group> groups_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_;
  int64_t skipped_steps_ = 0;
};

}  // namespace commgrad::optim
