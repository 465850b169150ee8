#pragma once
// Pipeline: runs a pipeline schedule (pp/schedule.h) over real stages.
//
// Each rank of the pipeline-parallel group holds v stages (callables, e.g.
// modules' forwards) of a model cut into ranks * v stages; stage s lives on
// rank s % ranks. step() splits the batch into microbatches, runs every
// action of this rank's list in order, sends activations and gradients over
// ops::raw point to point (each preceded by a small fixed header: stage,
// microbatch, dtype and shape, checked by the receiver), and leaves in the
// stages' parameters the gradient of the mean loss over the microbatches,
// as one rank computing the whole batch would. Sends are posted without
// waiting and waited for at the end of the step, receives taken when a
// computation needs them; the simulator proved every schedule free of
// deadlock even for a transport that does not buffer.

#include "commgrad/dist/group.h"
#include "commgrad/pp/schedule.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace commgrad::pp {

/// One stage: its forward (autograd records it; the stage's parameters get
/// their gradients from the pipeline's backward).
using StageFunction = std::function<at::Tensor(const at::Tensor& input)>;
/// The loss of one microbatch on the last stage: (output, targets) -> scalar.
using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

/// Holds off a stage's data-parallel gradient reduction while the guard it
/// returns lives (e.g. DistributedDataParallel::no_sync()).
using NoSyncFunction = std::function<std::shared_ptr<void>()>;

/// The NoSyncFunction of a DistributedDataParallel or ZeroOptimizer (or
/// anything with a no_sync() that returns a movable guard).
///
/// Example:
///   commgrad::pp::PipelineOptions(8).no_sync({commgrad::pp::no_sync_of(stage_ddp)})
template <class DataParallel>
NoSyncFunction no_sync_of(DataParallel& data_parallel) {
  return [&data_parallel] {
    using Guard = decltype(data_parallel.no_sync());
    return std::shared_ptr<void>(std::make_shared<Guard>(data_parallel.no_sync()));
  };
}

/// Options of Pipeline.
///
/// Example:
///   commgrad::pp::PipelineOptions(8).schedule("interleaved").stages_per_rank(2).group(pp_group)
struct PipelineOptions {
  /* implicit */ PipelineOptions(int microbatches) : microbatches_(microbatches) {}
  /// Microbatches per step (at least the number of pipeline ranks).
  TORCH_ARG(int, microbatches);
  /// "gpipe", "1f1b", "interleaved" or "zbh1" (zero bubble: the stages'
  /// forwards run under tp::DeferWeightGradients, so the weight gradients of
  /// commgrad's tp linear layers are computed in W actions of their own).
  TORCH_ARG(std::string, schedule) = "1f1b";
  /// v: stages on each rank (interleaved only).
  TORCH_ARG(int, stages_per_rank) = 1;
  /// The pipeline-parallel group (an undefined group: the world).
  TORCH_ARG(Group, group);
  /// With data parallelism: one per stage of this rank (e.g.
  /// no_sync_of(ddp) of the stage's DistributedDataParallel). Every
  /// backward of a stage but its last microbatch's runs under it, so the
  /// gradients are reduced over the DP group once per step, after the last
  /// microbatch, as Megatron does. One function for v > 1 stages (a single
  /// DistributedDataParallel or ZeroOptimizer over all of the rank's
  /// stages): every backward but the rank's last runs under it. With a
  /// split backward (zbh1) the last W takes the last backward's place.
  /// Empty: no data parallelism.
  TORCH_ARG(std::vector<NoSyncFunction>, no_sync);
};

/// What one step did.
struct PipelineStepResult {
  /// The mean loss over the microbatches, on every rank of the pipeline.
  double loss = 0;
  /// Each microbatch's loss (unscaled), on every rank.
  std::vector<double> microbatch_losses;
  /// This rank's time in its stages' forwards and backwards, and the wall
  /// time of its schedule (up to its sends' completion, before the loss
  /// broadcast), in seconds: 1 - compute / step is the rank's idle share
  /// (bubble and communication).
  double compute_seconds = 0;
  double step_seconds = 0;
  /// compute_seconds by action: forwards (the loss included), backwards (B
  /// alone when the schedule splits them) and W.
  double forward_seconds = 0;
  double backward_seconds = 0;
  double backward_weight_seconds = 0;
};

/// A model cut into stages over a pipeline-parallel group.
///
/// Example (4 stages on 2 ranks, 1F1B, 4 microbatches):
///   auto first = std::make_shared<Block>(), second = std::make_shared<Block>();   // this rank's stage
///   commgrad::pp::Pipeline pipe({[&](const at::Tensor& x) { return block->forward(x); }},
///                               [](const at::Tensor& y, const at::Tensor& t) { return torch::mse_loss(y, t); },
///                               commgrad::pp::PipelineOptions(4).group(pp_group));
///   opt.zero_grad();
///   auto result = pipe.step(batch_x, batch_y);   // inputs used on rank 0, targets on the last rank
///   opt.step();
class Pipeline {
 public:
  /// `stages` are this rank's, in increasing stage order (v of them).
  Pipeline(std::vector<StageFunction> stages, LossFunction loss, PipelineOptions options);
  ~Pipeline();
  Pipeline(Pipeline&&) noexcept;
  Pipeline& operator=(Pipeline&&) noexcept;

  /// Forward and backward of one batch. `inputs` is read on the rank of the
  /// first stage and `targets` on the rank of the last one (other ranks may
  /// pass undefined tensors); both split along dim 0 into the microbatches.
  /// Gradients accumulate into the stages' parameters. Collective over the
  /// group; errors name the stage and microbatch.
  PipelineStepResult step(const at::Tensor& inputs, const at::Tensor& targets);

  const Schedule& schedule() const;
  const Group& group() const;
  /// The global indices of this rank's stages.
  std::vector<int> stages() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace commgrad::pp
