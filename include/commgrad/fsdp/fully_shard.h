#pragma once
// fully_shard: parameters, gradients and optimizer state sharded over the
// data-parallel group (ZeRO-3, Rajbhandari et al., arXiv 1910.02054; the
// user model of PyTorch's FSDP2).
//
// A *unit* is the set of parameters of one module that no unit below it
// holds; fully_shard() is applied bottom-up (each transformer layer, then
// the whole model), as FSDP2's is. A unit's parameters live as one flat
// buffer, padded to a multiple of the group size, of which each rank keeps
// 1/N (its *shard*). The module's registered parameters become this rank's
// pieces of that shard, so `module->parameters()` is what an optimizer
// steps (any torch::optim optimizer whose update is per element) and what
// clipping and sharded checkpoints see; the tensors the module's code reads
// (the `weight` members) hold the whole parameter only while the unit runs.
//
// LibTorch modules have no forward hooks (pytorch#25888), so a sharded
// module is called through commgrad::fsdp::call(module, args...), which is
// Python's `module(args)`: forward with the hooks fully_shard installed.
//   * before forward: the unit's shards are all-gathered (the next unit's
//     all-gather is already in flight: prefetch in the order of the last
//     step), and the module's tensors point into the gathered buffer;
//   * after forward: the buffer is freed (reshard_after_forward; the
//     outermost unit keeps it for backward) and the outputs pass through an
//     autograd node that all-gathers again when backward reaches them;
//   * when backward has accumulated every gradient of the unit, the
//     gradients are packed, the buffer freed, and a reduce-scatter started
//     (in the reverse of the forward order on every rank), overlapped with
//     the rest of backward; at the end of backward this rank's pieces get
//     the averaged gradients (`.grad()`, accumulated across backwards).
// Memory and correctness rest on one device: freeing and refilling the
// *storage* the module's tensors share, never their autograd metadata, so
// that what autograd saved in forward reads the refilled values in backward.
//
// Example (FSDP2's recipe):
//   auto model = std::make_shared<Transformer>();
//   for (auto& layer : model->layers) commgrad::fsdp::fully_shard(layer);
//   auto sharded = commgrad::fsdp::fully_shard(model);       // the root
//   torch::optim::AdamW opt(model->parameters(), 1e-3);      // this rank's pieces
//   // in Transformer::forward:  x = commgrad::fsdp::call(layer, x);
//   auto loss = commgrad::fsdp::call(model, x).sum();
//   loss.backward();                                         // reduce-scatters
//   sharded.clip_grad_norm_(1.0);
//   opt.step();
//   opt.zero_grad();

#include "commgrad/dist/group.h"
#include "commgrad/dp/mixed_precision.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace commgrad::fsdp {

namespace detail {
class Unit;
}  // namespace detail

/// Options of fully_shard().
///
/// Example:
///   commgrad::fsdp::FullyShardOptions().reshard_after_forward(false)
///       .mixed_precision(commgrad::dp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat))
struct FullyShardOptions {
  /* implicit */ FullyShardOptions(Group group = Group()) : group_(std::move(group)) {}
  /// The group the unit is sharded over. Undefined: the current layout's
  /// data-parallel group (commgrad::default_data_parallel_group()), or the
  /// world without one. A group holding two ranks of the tensor-parallel
  /// group the module's parameters are split over is an error.
  TORCH_ARG(Group, group);
  /// HSDP (FSDP2's 2-D mesh): shard over `group`, replicate over this group
  /// (the ranks holding the same shard in the other replicas); gradients are
  /// reduce-scattered over `group`, then all-reduced over it. Undefined: none.
  TORCH_ARG(Group, replicate_group);
  /// Divide the summed gradients by this instead of the number of ranks
  /// holding a copy (0: that number, the sizes of group and replicate_group).
  /// Experts sharded over the expert-data group are summed there and divided
  /// by the data x context size (moe::fully_shard_experts, docs/moe.md).
  TORCH_ARG(int64_t, average_divisor) = 0;
  /// Free the gathered parameters after forward and gather them again in
  /// backward (ZeRO-3's memory); off: keep them from forward to backward
  /// (ZeRO-2's traffic). The outermost unit always keeps them.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// The compute, reduction and output dtypes; the shards stay in the
  /// parameters' own dtype (float32 master weights).
  TORCH_ARG(dp::MixedPrecisionPolicy, mixed_precision);
  /// Another rank of this group holds a copy of this unit that must stay
  /// equal (the embedding of a pipeline's first stage tied to the output
  /// layer of its last): finish_gradients() sums the unit's reduced
  /// gradient over it. The copies must be units of the same parameters
  /// (shapes, order) at the same data-parallel rank and size.
  TORCH_ARG(Group, tied_group);
};

/// What one unit holds on this rank (for inspection, tests and checkpoints).
struct UnitInfo {
  std::string module;  ///< the wrapped module's name in the outermost unit's tree ("" for it)
  int64_t numel = 0;   ///< elements of its parameters
  int64_t padded_numel = 0;
  int64_t shard_numel = 0;  ///< padded_numel / group size
  /// One entry per parameter overlapping this rank's shard.
  struct Segment {
    std::string name;          ///< named_parameters() name in the unit's module
    int64_t param_begin = 0;   ///< first element of the (flattened) parameter in the shard
    int64_t shard_offset = 0;  ///< where it sits in the shard
    int64_t length = 0;
    std::vector<int64_t> sizes;  ///< the parameter's shape (this rank's tensor-parallel shard of it)
  };
  std::vector<Segment> segments;
};

/// Collectives of the last synchronised step (forward and backward) of the
/// units of one tree.
struct StepStats {
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  /// All-gathers started ahead of the unit that needed them.
  int64_t prefetched = 0;
};

/// The handle of a sharded module (the units of its tree, itself included).
/// Copies share the state; the state lives as long as the module.
class FullyShardedModule {
 public:
  FullyShardedModule() = default;
  explicit FullyShardedModule(std::shared_ptr<detail::Unit> unit);

  /// Backward reduce-scatters (true, the default) or only accumulates the
  /// unsharded gradients locally (gradient accumulation). Applies to every
  /// unit of the tree.
  void set_requires_gradient_sync(bool sync);

  /// Scope guard of no_sync(): gradients accumulate locally while it lives.
  class NoSync {
   public:
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    friend class FullyShardedModule;
    explicit NoSync(std::shared_ptr<detail::Unit> unit);
    std::shared_ptr<detail::Unit> unit_;
    bool previous_ = true;
  };
  /// Gradient accumulation without communication; the next synchronised
  /// backward reduces the sum.
  [[nodiscard]] NoSync no_sync();

  /// Sums the reduced gradients of tied units over their tied_group and
  /// waits for anything still in flight; call after the last backward of a
  /// step, before clipping and the optimizer step, on every rank (a pipeline
  /// runs it after its schedule). Nothing to do without tied units.
  void finish_gradients();

  /// Scales the pieces' gradients so that the global L2 norm is at most
  /// `max_norm`; returns the norm before clipping. The norm counts every
  /// shard (summed over the group) and, with `tensor_parallel` and
  /// `pipeline_parallel` groups, every TP rank and stage, TP-replicated
  /// parameters once (optim::clip_grad_norm_'s factor). A unit sharded over
  /// a smaller group than the outermost unit's (the experts of
  /// moe::fully_shard_experts, whose other ranks in the outermost group hold
  /// other experts) is summed over the outermost unit's group as well: each
  /// expert counts once. Collective. Groups
  /// not given are the current layout's (commgrad::default_tensor_parallel_
  /// group() and its pipeline sibling); without a layout the TP group is the
  /// one the module's partitioned parameters are split over. A given TP
  /// group other than theirs is an error.
  double clip_grad_norm_(double max_norm, const Group& tensor_parallel = Group(),
                         const Group& pipeline_parallel = Group());

  /// The whole parameters, gathered (collective over the group; every rank
  /// gets them): named_parameters() names -> tensors of the parameters'
  /// shapes and own dtype.
  torch::OrderedDict<std::string, at::Tensor> full_state_dict();
  /// Loads whole parameters (from full_state_dict() or an unsharded model):
  /// each rank keeps its pieces. Local.
  void load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& full);

  /// The units of the tree, innermost first.
  std::vector<UnitInfo> units() const;
  /// The outermost module of the tree (the names of units() are relative to it).
  std::shared_ptr<torch::nn::Module> module() const;
  const Group& group() const;
  const FullyShardOptions& options() const;
  /// Collectives of the last synchronised step.
  StepStats last_step() const;
  /// Bytes of parameters this rank holds now: the shards plus any gathered
  /// buffers that are alive.
  int64_t parameter_bytes() const;
  /// Bytes of gradients this rank holds now: the pieces' `.grad()` plus any
  /// unsharded gradients (accumulated under no_sync).
  int64_t gradient_bytes() const;

  const std::shared_ptr<detail::Unit>& unit() const { return unit_; }

 private:
  std::shared_ptr<detail::Unit> unit_;
};

/// Shards `module`'s parameters that no unit below it holds into a new unit
/// over options.group() and returns the handle of the tree it now heads.
/// Collective over the group: the ranks must wrap the same parameters
/// (names, shapes, dtypes, in order; checked) and start from the values of
/// the group's first rank (broadcast). Errors when the module is already a
/// unit or its parameters are not all of one dtype.
FullyShardedModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options = {});
template <typename ModuleType>
FullyShardedModule fully_shard(const torch::nn::ModuleHolder<ModuleType>& module, FullyShardOptions options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(options));
}

namespace detail {
/// The unit of `module`, or null when it is not one.
std::shared_ptr<Unit> unit_of(const torch::nn::Module& module);
/// Opens a call of `unit`'s module: checks, gathers, prefetches.
void before_forward(Unit& unit);
/// Closes it: reshards and routes the outputs through the backward hook
/// (tensors that require grad; others pass unchanged).
std::vector<at::Tensor> after_forward(Unit& unit, std::vector<at::Tensor> outputs);
/// Closes a call that threw.
void abandon_forward(Unit& unit) noexcept;
/// Casts a floating input to the unit's compute dtype (outermost call only).
at::Tensor cast_input(Unit& unit, const at::Tensor& input);

template <class T>
decltype(auto) cast_argument(Unit& unit, T&& value) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return at::Tensor(cast_input(unit, value));
  } else {
    return std::forward<T>(value);
  }
}

template <class Out>
Out finish_forward(Unit& unit, Out out) {
  if constexpr (std::is_same_v<Out, at::Tensor>) {
    return after_forward(unit, {std::move(out)})[0];
  } else if constexpr (std::is_same_v<Out, std::vector<at::Tensor>>) {
    return after_forward(unit, std::move(out));
  } else {
    static_assert(std::is_same_v<Out, at::Tensor>,
                  "commgrad::fsdp::call: a sharded module's forward must return a tensor or a vector of tensors");
    return out;
  }
}
}  // namespace detail

/// Runs `fn()` (which calls `module`'s code) with the hooks of `module`'s
/// unit; just `fn()` when `module` is not a unit. For forwards other than
/// `forward` (a pipeline stage's forward_stage(k, x)).
///
/// Example:
///   auto y = commgrad::fsdp::call_function(*model, [&] { return model->forward_stage(0, x); });
template <class Fn>
auto call_function(const torch::nn::Module& module, Fn&& fn) {
  auto unit = detail::unit_of(module);
  if (!unit) return fn();
  detail::before_forward(*unit);
  try {
    return detail::finish_forward(*unit, fn());
  } catch (...) {
    detail::abandon_forward(*unit);
    throw;
  }
}

/// `module->forward(args...)` with the hooks of fully_shard (Python's
/// `module(args)`); a plain forward when the module is not a unit. Tensor
/// arguments of the outermost unit are cast to its compute dtype.
///
/// Example:
///   for (auto& layer : layers) x = commgrad::fsdp::call(layer, x);
template <class Holder, class... Args>
auto call(Holder& module, Args&&... args) {
  auto unit = detail::unit_of(*module);
  if (!unit) return module->forward(std::forward<Args>(args)...);
  return call_function(*module,
                       [&] { return module->forward(detail::cast_argument(*unit, std::forward<Args>(args))...); });
}

}  // namespace commgrad::fsdp
