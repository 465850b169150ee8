#pragma once
// The trajectory checker: a whole training run against one rank. Where
// check_gradients() compares one forward and backward, check_trajectory()
// trains N steps of a parallel training loop (tensor-, data-parallel,
// ZeRO, clipping, ...) and of its one-rank reference side by side, and
// compares the loss of every step and, at the end, every parameter (the
// parallel model's shards gathered into full tensors) — what
// `gpt_train --check` does, for any loop.
//
// Each side is a function that trains one step and returns its loss. The
// parallel side returns this rank's loss; the checker averages it over the
// data-parallel group (every rank's batch is the same size, so this is the
// loss of the global batch). The reference side runs on every rank alone:
// build its model with commgrad::self_group() (or under a
// ScopedParallelState of make_model_parallel(1, 1, commgrad::self_group())).
//
// Example:
//   auto result = check::check_trajectory(
//       [&](int k) { return train_step(parallel_model, zero, batch(k)); }, *parallel_model,
//       [&](int k) { return train_step(reference_model, adamw, batch(k)); }, *reference_model,
//       check::TrajectoryOptions(10));
//   if (commgrad::rank() == 0) std::cout << result;
//   if (!result.ok()) return 1;

#include "commgrad/check/gradient_check.h"
#include "commgrad/dist/group.h"

#include <torch/arg.h>

#include <functional>
#include <ostream>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace commgrad::check {

/// Trains step `step` (0, 1, ...) of one side and returns its loss.
using StepFn = std::function<double(int step)>;

/// Options of check_trajectory().
///
/// Example:
///   check::TrajectoryOptions(20).rtol(1e-4)
struct TrajectoryOptions {
  /* implicit */ TrajectoryOptions(int steps = 10) : steps_(steps) {}
  /// Steps to train on each side.
  TORCH_ARG(int, steps);
  /// The parallel side's loss is averaged over this group (undefined:
  /// commgrad::default_data_parallel_group()).
  TORCH_ARG(Group, data_parallel_group);
  /// A loss or a parameter passes when |p - r| <= atol + rtol * max|r|
  /// (float32 training drifts by rounding: about 1e-7 per step).
  TORCH_ARG(double, atol) = 1e-6;
  TORCH_ARG(double, rtol) = 1e-5;
  /// Heading of the printed table.
  TORCH_ARG(std::string, title) = "";
};

/// What check_trajectory() found; the same on every rank.
struct TrajectoryResult {
  std::string title;
  std::vector<double> losses;            ///< the parallel run's, averaged over the data-parallel group
  std::vector<double> reference_losses;  ///< the one-rank run's
  std::vector<TensorReport> parameters;  ///< the final parameters, full
  /// The first step whose losses differ beyond the tolerance (-1: none).
  int first_divergent_step = -1;

  /// True when every step's loss and every final parameter passed.
  bool ok() const;
  /// One line per step, one per parameter, a verdict line.
  std::string table() const;
};

/// Prints result.table().
std::ostream& operator<<(std::ostream& out, const TrajectoryResult& result);

/// Trains options.steps() steps of `parallel_step` and of `reference_step`
/// (step k of one, then step k of the other), compares the losses step by
/// step and, at the end, `parallel_model`'s parameters (gathered over their
/// tensor-parallel groups: tp::gather_full_state_dict(); a fully_shard
/// model is not supported) with `reference_model`'s, by name. Collective
/// over the data-parallel group and the model's tensor-parallel groups;
/// every rank gets the same result. A parameter of either model missing in
/// the other is a failed report.
TrajectoryResult check_trajectory(const StepFn& parallel_step, const torch::nn::Module& parallel_model,
                                  const StepFn& reference_step, const torch::nn::Module& reference_model,
                                  const TrajectoryOptions& options = {});

}  // namespace commgrad::check
