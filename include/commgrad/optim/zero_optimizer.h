#pragma once
// ZeroOptimizer: ZeRO-1 and ZeRO-2 (Rajbhandari et al., arXiv 1910.02054) on
// commgrad's DistributedDataParallel buckets.
//
// Every rank of the data-parallel group keeps the optimizer state of 1/N of
// the parameters only. Each gradient bucket is split into N equal element
// ranges (parameters may straddle a boundary); backward reduce-scatters the
// buckets (started from DDP's hooks, overlapped with the rest of backward)
// so each rank receives the averaged gradients of its range; step() runs any
// torch::optim optimizer on this rank's ranges alone and all-gathers the
// updated parameters. With Adam in float32 a rank then holds 4 (parameters)
// + 4 (ZeRO-1) or 4/N (ZeRO-2) (gradients) + 8/N (state) bytes per parameter
// instead of DDP's 16.

#include "commgrad/dist/group.h"
#include "commgrad/dp/distributed_data_parallel.h"
#include "commgrad/dp/mixed_precision.h"
#include "commgrad/optim/param_state.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace commgrad::optim {

class ZeroOptimizer;
class DynamicLossScaler;
/// A ZeroOptimizer in an options struct (TORCH_ARG needs one name for the type).
using ZeroOptimizerPtr = ZeroOptimizer*;
/// A DynamicLossScaler in an options struct.
using DynamicLossScalerPtr = DynamicLossScaler*;

/// Makes the optimizer that steps this rank's shards (one flat tensor per
/// bucket). Any torch::optim optimizer whose update is per element works
/// (SGD with momentum, Adam, AdamW, Adagrad, RMSprop); weight decay applies
/// to every element (one parameter group).
///
/// Example:
///   [](std::vector<at::Tensor> shards) {
///     return std::make_unique<torch::optim::AdamW>(shards, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
///   }
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> shards)>;

/// Options of ZeroOptimizer.
///
/// Example:
///   commgrad::optim::ZeroOptimizerOptions(dp_group).stage(2).max_grad_norm(1.0)
struct ZeroOptimizerOptions {
  /// `ddp` sets the data-parallel group (undefined: the current layout's,
  /// or the world without one) and the buckets; ZeroOptimizer pads them and
  /// installs its own hook.
  /* implicit */ ZeroOptimizerOptions(dp::DistributedDataParallelOptions ddp = {}) : ddp_(std::move(ddp)) {}
  /// 1: optimizer state sharded; 2: gradients sharded too (no `.grad()` is
  /// kept between steps; see DistributedDataParallelOptions::release_gradients).
  TORCH_ARG(int, stage) = 1;
  /// Clip gradients to this global L2 norm before the step (0: no clipping).
  /// The norm is over every shard and, with tensor_parallel_group, every TP
  /// rank, counting TP-replicated parameters once.
  TORCH_ARG(double, max_grad_norm) = 0;
  /// Mixed precision (dp/mixed_precision.h), the struct fully_shard and DDP
  /// take: `param_dtype` casts the module's parameters (DDP does it at
  /// construction); `reduce_dtype` is the dtype gradients are
  /// reduce-scattered in (float16/bfloat16 sums split the average around
  /// them); `float32_master` keeps this rank's ranges of float16/bfloat16
  /// parameters in float32 (master weights, with float32 gradients and
  /// state) and gives the parameters the rounded result after each step
  /// (off: step in the parameters' own dtype). `output_dtype` is an error
  /// (forward is not wrapped). This struct's policy replaces `ddp`'s.
  ///
  /// Example:
  ///   ZeroOptimizerOptions(dp).mixed_precision(
  ///       commgrad::dp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat))
  TORCH_ARG(dp::MixedPrecisionPolicy, mixed_precision);

 public:
  /// Deprecated alias of mixed_precision().float32_master() (kept for one
  /// release).
  ZeroOptimizerOptions& float32_master(bool on) {
    mixed_precision_.float32_master(on);
    return *this;
  }
  bool float32_master() const { return mixed_precision_.float32_master(); }
  /// Dynamic loss scaling (float16): step() unscales this rank's ranges of
  /// the reduced gradients, agrees with every rank of the scaler's groups
  /// on inf/NaN (they must include the data-parallel group), skips the step
  /// on every rank when any found one, and updates the scale. Scale the loss
  /// with the same scaler (scaler.scale(loss).backward()). The scaler must
  /// outlive the optimizer; null: none.
  TORCH_ARG(DynamicLossScalerPtr, loss_scaler) = nullptr;
  /// The tensor-parallel group, when the module holds TP shards (undefined:
  /// the current layout's when its TP size is above 1, else the group the
  /// module's partitioned parameters are split over; a group other than
  /// theirs is an error at construction): clipping counts
  /// TP-replicated parameters once over it. Parameters marked partial_grad
  /// (sequence parallelism) are summed over it in step(), so do not call
  /// tp::allreduce_sequence_parallel_grads() with a ZeroOptimizer.
  TORCH_ARG(Group, tensor_parallel_group);
  /// The pipeline-parallel group, when the module is one stage of a
  /// pipeline (undefined: the current layout's when its PP size is above
  /// 1): the global norm for clipping then sums over the stages too.
  TORCH_ARG(Group, pipeline_parallel_group);
  /// Parameters (named_parameters() names) of which another rank of
  /// `tied_group` holds a copy that must stay equal: the input embedding of
  /// a pipeline's first stage tied to the output layer of its last
  /// (Megatron's shared embedding). Each gets a bucket of its own, so every
  /// copy is split into the same ranges over the data-parallel group; step()
  /// sums this rank's range of their reduced gradients over `tied_group`
  /// (after the data-parallel reduce-scatter, as Megatron does) and the
  /// global norm counts them once. Every rank of `tied_group` must name
  /// parameters of the same shapes, in the same order, at the same
  /// data-parallel rank and size.
  TORCH_ARG(std::vector<std::string>, tied_parameters);
  /// The ranks holding the copies of tied_parameters
  /// (commgrad::ParallelState::embedding_group()).
  TORCH_ARG(Group, tied_group);
  /// DistributedDataParallel's options (group, bucket sizes, reduction).
  TORCH_ARG(dp::DistributedDataParallelOptions, ddp);
  /// Another ZeroOptimizer over other parameters of the same module (the
  /// experts', over the expert-data group: moe::expert_ddp_options()),
  /// clipped with this one by one global norm: its squares, summed over its
  /// own group and `clip_partner_group` (the expert-parallel group: each rank
  /// holds other experts), join this one's before the TP and PP sums, and its
  /// reduced gradients are scaled by the same factor. Step it after this one,
  /// with max_grad_norm 0 and the same tensor_parallel_group.
  TORCH_ARG(ZeroOptimizerPtr, clip_partner) = nullptr;
  TORCH_ARG(Group, clip_partner_group);
};

/// This rank's part of one bucket (for inspection, tests and checkpoints).
struct ZeroShardInfo {
  /// The bucket's elements, padded to a multiple of the group size.
  int64_t bucket_numel = 0;
  int64_t padded_numel = 0;
  /// This rank's range [begin, end) of the bucket (end <= bucket_numel).
  int64_t begin = 0;
  int64_t end = 0;
  /// The dtype of the range's master weights, gradient and state (float32
  /// with float32_master for 16-bit parameters; else the parameters').
  /// The reduced gradient arrives in the policy's reduce dtype.
  at::ScalarType state_dtype = at::kFloat;
  /// One entry per parameter overlapping the range.
  struct Segment {
    std::string name;          ///< the parameter (named_parameters() name)
    int64_t param_begin = 0;   ///< first element of the parameter (flattened) in the range
    int64_t shard_offset = 0;  ///< where it sits in the shard
    int64_t length = 0;
  };
  std::vector<Segment> segments;
};

/// A sharded optimizer for a module: construct it instead of
/// DistributedDataParallel plus a torch::optim optimizer, then train as usual.
///
/// The constructor wraps the module in DistributedDataParallel (same replica
/// check and broadcast), makes each bucket's parameters views of one flat
/// buffer (so the all-gather writes them in place), and creates the inner
/// optimizer over this rank's ranges. After `backward()` this rank's range of
/// each bucket holds the averaged gradient; step() clips (optionally), steps
/// and all-gathers. With ZeRO-1 `.grad()` of the parameters are the bucket
/// views and hold meaningful (reduced) values only inside this rank's
/// ranges; with ZeRO-2 they are undefined after a synchronised backward.
///
/// Example:
///   commgrad::optim::ZeroOptimizer zero(model, [](auto shards) {
///     return std::make_unique<torch::optim::Adam>(shards, torch::optim::AdamOptions(1e-3));
///   }, commgrad::optim::ZeroOptimizerOptions(dp_group).stage(2).max_grad_norm(1.0));
///   for (auto& [x, y] : my_shard_of_each_batch) {
///     zero.zero_grad();
///     torch::mse_loss(model->forward(x), y).backward();  // reduce-scatters in buckets
///     zero.step();                                        // steps 1/N, all-gathers
///   }
class ZeroOptimizer {
 public:
  ZeroOptimizer(std::shared_ptr<torch::nn::Module> module, OptimizerFactory make_optimizer,
                ZeroOptimizerOptions options = {});
  template <typename ModuleType>
  ZeroOptimizer(const torch::nn::ModuleHolder<ModuleType>& module, OptimizerFactory make_optimizer,
                ZeroOptimizerOptions options = {})
      : ZeroOptimizer(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(make_optimizer),
                      std::move(options)) {}
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  /// Clips (when max_grad_norm is set), steps this rank's shards and
  /// all-gathers the parameters. Collective over the data-parallel group.
  /// Returns the global gradient norm before clipping when clipping, else -1;
  /// NaN when the loss scaler found inf/NaN and every rank skipped the step.
  /// Errors when no synchronised backward ran since the last step.
  double step();
  /// Zeroes the gradients (ZeRO-1: the bucket views in place; ZeRO-2: there
  /// are none to zero between steps).
  void zero_grad();
  /// Gradient accumulation without communication (DistributedDataParallel::no_sync()).
  [[nodiscard]] dp::DistributedDataParallel::NoSync no_sync();

  /// The optimizer over this rank's shards: for learning-rate schedules
  /// (torch::optim::StepLR(zero.optimizer(), ...)) and options.
  torch::optim::Optimizer& optimizer();
  /// The underlying DistributedDataParallel (buckets, last_step()).
  dp::DistributedDataParallel& ddp();
  const Group& group() const;
  const ZeroOptimizerOptions& options() const;
  /// This rank's range of each bucket, in bucket order.
  std::vector<ZeroShardInfo> shards() const;
  /// Bytes of optimizer state this rank holds, float32 master weights
  /// included (0 before the first step).
  int64_t state_bytes() const;
  /// Bytes of gradients kept between steps (ZeRO-1: DDP's buckets, whose
  /// ranges are the shards' gradients; ZeRO-2: the shards, in the
  /// parameters' dtype).
  int64_t gradient_bytes() const;

  /// The state tensors the optimizer can keep per element: the inner
  /// optimizer's (param_state_names()) and "master" with float32 masters.
  std::vector<std::string> state_names();

  /// This rank's state of one parameter's part: `tensor` is a 1-D view of
  /// elements [param_begin, param_begin + numel) of the flattened parameter.
  struct StateShard {
    std::string param;  ///< parameter name
    std::string state;  ///< "exp_avg", "momentum_buffer", ...
    int64_t param_begin = 0;
    at::Tensor tensor;
  };
  /// The sharded state (views, no copies), for sharded checkpoints; with
  /// float32 master weights also their ranges, as state "master". Empty
  /// before the first step.
  std::vector<StateShard> state_shards() const;
  /// Called by step() with this rank's ranges of the gradients the inner
  /// optimizer steps on (state "grad"; float32 with float32 masters): after
  /// the reductions, the sums of sequence-parallel and tied parameters and
  /// the loss scaler's unscale (on a step the scaler skips they may hold
  /// inf/NaN), before clipping. A clip partner's hooks run from its main
  /// optimizer's step(), before the shared clip. A hook may read the
  /// tensors (views) or change them in place: checks that compare the
  /// gradients with a reference, fault injection. Hooks run in order of
  /// registration.
  ///
  /// Example:
  ///   zero.register_gradient_hook([](const std::vector<ZeroOptimizer::StateShard>& grads) {
  ///     for (const auto& g : grads) std::cout << g.param << " " << g.tensor.norm().item<double>() << "\n";
  ///   });
  using GradientHook = std::function<void(const std::vector<StateShard>& gradients)>;
  void register_gradient_hook(GradientHook hook);

  /// The optimizer's step count (its first shard's), 0 before the first step.
  int64_t step_count() const;
  /// Copies `shards` (as state_shards() describes them, for this rank's
  /// ranges) into the optimizer's state and sets its step count.
  void load_state_shards(const std::vector<StateShard>& shards, int64_t step);

  /// The whole optimizer state, gathered over the group (collective; every
  /// rank gets it): "<param>/<state>" -> tensor shaped like the parameter
  /// (with float32 master weights also "<param>/master"), and "step" -> int64
  /// scalar. The same keys as full_state_dict() of an
  /// unsharded optimizer (see unsharded_state_dict()).
  torch::OrderedDict<std::string, at::Tensor> full_state_dict();
  /// Loads a full state dict (from full_state_dict() or
  /// unsharded_state_dict(), of any group size): each rank keeps its ranges.
  void load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& full);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The state of an unsharded optimizer over `module`'s parameters, with the
/// keys of ZeroOptimizer::full_state_dict() (for comparisons and conversion).
torch::OrderedDict<std::string, at::Tensor> unsharded_state_dict(const torch::nn::Module& module,
                                                                 torch::optim::Optimizer& optimizer);

}  // namespace commgrad::optim
