#pragma once
// DistributedDataParallel: data parallelism for any torch::nn::Module.
//
// Each rank of a data-parallel group holds a full replica of the module and
// runs forward and backward on its own shard of the batch. The wrapper
// makes the replicas start equal and stay equal: after every backward each
// parameter's gradient is the average (or sum) of the ranks' gradients, so
// identical optimizer steps keep identical parameters. Gradients are
// reduced in buckets whose all-reduces start while backward is still
// computing the remaining gradients (see src/dp/reducer.cpp).

#include "commgrad/dist/group.h"
#include "commgrad/dp/comm_hooks.h"
#include "commgrad/dp/mixed_precision.h"

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <vector>

namespace commgrad::dp {

namespace detail {
class DdpReducer;
}

/// How the gradients of the ranks are combined.
///
/// Example:
///   commgrad::dp::DistributedDataParallelOptions().reduction(commgrad::dp::GradReduction::kSum)
enum class GradReduction {
  kAverage,  ///< mean over the group (like PyTorch's DDP)
  kSum,      ///< sum over the group
};

/// Options of DistributedDataParallel.
///
/// Example:
///   commgrad::dp::DistributedDataParallelOptions(dp_group).bucket_cap_mb(8).find_unused_parameters(true)
struct DistributedDataParallelOptions {
  /// `group` is the data-parallel group; an undefined group means the
  /// current layout's (commgrad::default_data_parallel_group()).
  /* implicit */ DistributedDataParallelOptions(Group group = Group()) : group_(std::move(group)) {}

  /// The data-parallel group. Undefined: the current parallel layout's DP
  /// group (each rank then reduces its own shards with the ranks that hold
  /// the same shards in the other replicas), or the world when no layout is
  /// current. A group holding two ranks of the tensor-parallel group the
  /// module's parameters are split over is an error (tp/wiring_checks.h).
  TORCH_ARG(Group, group);
  /// Bucket size in MiB (PyTorch's default, 25). Gradients are packed into
  /// buckets of about this size, in reverse registration order.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Size of the first bucket in MiB: small, so that the first all-reduce
  /// starts early in backward (PyTorch uses 1 MiB).
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Average (default) or sum the gradients over the group.
  TORCH_ARG(GradReduction, reduction) = GradReduction::kAverage;
  /// Tolerate parameters that get no gradient in a backward: they count as
  /// zero on that rank. Without it such a parameter is an error naming it.
  /// A parameter that gets no gradient on any rank keeps its old .grad().
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// After each synchronised backward, broadcast the module's buffers (batch
  /// norm statistics, ...) from the group's first rank, so every forward
  /// sees the same buffers, as PyTorch's DDP does before each forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Make each parameter's .grad() a view into its bucket: backward then
  /// accumulates straight into the buffer that is all-reduced, and the
  /// averaged gradient needs no copy back. Off: one copy in, one copy out.
  TORCH_ARG(bool, gradient_as_bucket_view) = true;
  /// Pads each bucket's buffer with zeros to a multiple of this many
  /// elements. A sharded optimizer pads to the group size, so that a
  /// reduce-scatter splits every bucket into equal parts.
  TORCH_ARG(int64_t, bucket_multiple) = 1;
  /// Parameters (named_parameters() names) that get a bucket of their own.
  /// A sharded optimizer puts a tied parameter (one copy on each of two
  /// pipeline stages) there, so that every copy splits into the same ranges.
  TORCH_ARG(std::vector<std::string>, own_bucket);
  /// Gradients live only as long as their reduction (ZeRO-2): the hook copies
  /// each gradient into its bucket and drops `.grad()`; a bucket's buffer is
  /// allocated when its first gradient arrives and freed once its hook's
  /// `then` has run, and at most two buckets are in flight during backward.
  /// After a synchronised backward no parameter has a `.grad()`: the result
  /// exists only where the communication hook put it. Implies
  /// gradient_as_bucket_view(false).
  TORCH_ARG(bool, release_gradients) = false;
  /// Parameters (named_parameters() names) this wrapper leaves alone: not
  /// checked, broadcast nor reduced. Another wrapper over another group
  /// takes them (experts: moe::expert_ddp_options()).
  TORCH_ARG(std::vector<std::string>, ignored_parameters);
  /// With kAverage, divide the summed gradients by this instead of the group
  /// size (0: the group size). Expert parameters are summed over the
  /// expert-data group and divided by the data x context size (docs/moe.md).
  TORCH_ARG(int64_t, average_divisor) = 0;
  /// Mixed precision (dp/mixed_precision.h): `param_dtype` casts the
  /// module's trainable floating parameters at construction (the module then
  /// computes in it); `reduce_dtype` is the dtype of the buckets (gradients
  /// are cast into them, summed, and cast back into `.grad()`); a 16-bit
  /// reduction divides part of the average before the sum and the rest after
  /// it. `output_dtype` is an error (DDP does not wrap forward);
  /// `float32_master` is the caller's optimizer's business.
  ///
  /// Example:
  ///   DistributedDataParallelOptions(dp).mixed_precision(
  ///       commgrad::dp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat))
  TORCH_ARG(MixedPrecisionPolicy, mixed_precision);
};

/// One bucket as built at construction (for inspection and tests).
///
/// Example:
///   for (const auto& b : ddp.buckets()) std::cout << b.names.size() << " parameters, " << b.numel << "\n";
struct DdpBucketInfo {
  /// The dtype the bucket is reduced in (mixed_precision's reduce_dtype).
  at::ScalarType dtype;
  /// The dtype of its parameters and their gradients.
  at::ScalarType param_dtype;
  /// Elements of the parameters in the bucket (without padding).
  int64_t numel = 0;
  /// Elements of the buffer: numel rounded up to bucket_multiple.
  int64_t padded_numel = 0;
  /// Parameter names in the order they sit in the bucket.
  std::vector<std::string> names;
};

/// What happened in the last synchronised backward.
///
/// Example:
///   loss.backward();
///   auto stats = ddp.last_step();   // e.g. 5 buckets, 5 launched in backward, waited 0.8 ms
struct DdpStepStats {
  /// Buckets reduced, and how many of them started before backward ended.
  int64_t buckets = 0;
  int64_t launched_in_backward = 0;
  /// Parameters that got no gradient on this rank (find_unused_parameters).
  std::vector<std::string> unused_parameters;
  /// Time the end of backward spent waiting for reductions, in milliseconds.
  double wait_ms = 0;
};

/// Data parallelism for a module: attach it once, then train as usual.
///
/// At construction it checks that every rank of the group has the same
/// parameters (names, shapes, dtypes, in order), broadcasts parameters and
/// buffers from the group's first rank, builds the gradient buckets and
/// installs one autograd hook per parameter. From then on every backward
/// through the module reduces the gradients over the group before
/// `backward()` returns; `.grad()` then holds the average (or sum).
///
/// The module is used directly (forward is not wrapped). One synchronised
/// backward per optimizer step; for gradient accumulation use no_sync().
/// Reentrant backward (activation checkpointing that calls backward inside
/// backward) is not supported.
///
/// Example:
///   auto model = std::make_shared<Net>();
///   commgrad::dp::DistributedDataParallel ddp(model);        // world group
///   torch::optim::SGD opt(model->parameters(), 0.1);
///   for (auto& [x, y] : my_shard_of_each_batch) {
///     opt.zero_grad();
///     torch::mse_loss(model->forward(x), y).backward();  // all-reduces in buckets
///     opt.step();
///   }
class DistributedDataParallel {
 public:
  explicit DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                   DistributedDataParallelOptions options = {});
  template <typename ModuleType>
  explicit DistributedDataParallel(const torch::nn::ModuleHolder<ModuleType>& module,
                                   DistributedDataParallelOptions options = {})
      : DistributedDataParallel(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(options)) {}

  /// Removes the hooks; the module keeps working without communication.
  ~DistributedDataParallel();
  DistributedDataParallel(DistributedDataParallel&&) noexcept;
  DistributedDataParallel& operator=(DistributedDataParallel&&) noexcept;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// The module whose gradients are synchronised.
  const std::shared_ptr<torch::nn::Module>& module() const;
  /// The data-parallel group.
  const Group& group() const;
  const DistributedDataParallelOptions& options() const;

  /// Scope guard returned by no_sync(): while it lives, backward does not
  /// communicate and gradients accumulate locally; the next backward after it
  /// reduces the accumulated gradients.
  class NoSync {
   public:
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    friend class DistributedDataParallel;
    explicit NoSync(std::shared_ptr<detail::DdpReducer> reducer);
    std::shared_ptr<detail::DdpReducer> reducer_;
    bool previous_ = true;
  };

  /// Gradient accumulation without communication.
  ///
  /// Example:
  ///   {
  ///     auto guard = ddp.no_sync();
  ///     for (int i = 0; i < 3; ++i) loss(micro[i]).backward();  // local only
  ///   }
  ///   loss(micro[3]).backward();  // reduces the sum of all four
  [[nodiscard]] NoSync no_sync();

  /// Replaces how each bucket is summed (default: allreduce_hook()). Call it
  /// on every rank, before the first backward.
  ///
  /// Example:
  ///   ddp.register_comm_hook(commgrad::dp::bf16_compress_hook());
  void register_comm_hook(CommHook hook);

  /// Broadcasts the module's buffers from the group's first rank now.
  void sync_buffers();

  /// The buckets, in the order they are reduced.
  std::vector<DdpBucketInfo> buckets() const;
  /// Statistics of the last synchronised backward.
  DdpStepStats last_step() const;

 private:
  detail::DdpReducer& reducer() const;
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<detail::DdpReducer> reducer_;
};

}  // namespace commgrad::dp

namespace commgrad {
// The names before the dp namespace existed.
using dp::DdpBucketInfo;
using dp::DdpStepStats;
using dp::DistributedDataParallel;
using dp::DistributedDataParallelOptions;
using dp::GradReduction;
}  // namespace commgrad
