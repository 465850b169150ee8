#pragma once
// How tensor-parallel parameters are split across the ranks of their group,
// and the state-dict helpers built on it.
//
// Every parallel layer says, per parameter, whether it is partitioned (and
// along which dim) or replicated, by deriving from ShardedModule. The
// gradient checker uses this to gather shards and gradients into full
// tensors; gather_full_state_dict() / load_full_state_dict() use it to save
// and load checkpoints that do not depend on the TP size.
//
// Strided partitions (Megatron's `stride`): a dim of full size S is cut into
// stride * n equal blocks, and rank r holds blocks r, r + n, r + 2n, ...
// concatenated. With stride 1 rank r holds the r-th contiguous slice. A fused
// QKV weight [3h, h] split by heads uses stride 3: rank r holds
// [Q_r; K_r; V_r].

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <map>
#include <ostream>
#include <string>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace commgrad::tp {

/// How one tensor is laid out across a tensor-parallel group.
///
/// Example:
///   auto w = tp::ShardSpec::partitioned(0);       // rows split (column-parallel weight)
///   auto b = tp::ShardSpec::replicated();          // identical on every rank
///   auto ln = tp::ShardSpec::sequence_parallel();  // replicated, gradient summed over TP
struct ShardSpec {
  /// Partition dim (negative counts from the end); kReplicated for none.
  int64_t dim = kReplicated;
  /// Blocks per rank of a strided partition (see the file comment).
  int64_t stride = 1;
  /// For replicated parameters used inside a sequence-parallel region: each
  /// rank's gradient covers only its part of the sequence, so the gradients
  /// are summed across the TP group after backward
  /// (allreduce_sequence_parallel_grads()).
  bool partial_grad = false;

  static constexpr int64_t kReplicated = INT64_MIN;

  static ShardSpec replicated() { return {}; }
  static ShardSpec partitioned(int64_t dim, int64_t stride = 1) { return {dim, stride, false}; }
  static ShardSpec sequence_parallel() { return {kReplicated, 1, true}; }

  bool is_partitioned() const { return dim != kReplicated; }
  /// "replicated", "split(0)", "split(-1)", "split(0, stride 3)", "replicated, partial grad".
  std::string describe() const;
};

std::ostream& operator<<(std::ostream& out, const ShardSpec& spec);

/// Rank `rank`'s shard (a copy, contiguous) of the full tensor `full` split
/// `size` ways by `spec`; `full` itself when replicated. Errors when the dim
/// is not divisible by size * stride.
///
/// Example:
///   auto mine = tp::shard_tensor(full_weight, tp::ShardSpec::partitioned(0), g.rank(), g.size());
at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int rank, int size);

/// The full tensor from every rank's shard, by rank (inverse of shard_tensor).
at::Tensor unshard_tensors(const std::vector<at::Tensor>& shards, const ShardSpec& spec);

/// All-gathers the shards of `local` over `group` into the full tensor
/// (collective, not differentiable); `local` itself when replicated.
at::Tensor gather_shards(const at::Tensor& local, const ShardSpec& spec, const Group& group);

/// Mixin for modules whose parameters are split across a tensor-parallel
/// group. A spec names a parameter of this module ("weight") or of a
/// descendant ("ln1.weight", e.g. a LayerNorm inside a sequence-parallel
/// region); parameters without a spec are replicated.
///
/// Example:
///   struct MyLayerImpl : torch::nn::Cloneable<MyLayerImpl>, tp::ShardedModule {
///     void reset() override {
///       weight = register_parameter("weight", ...);
///       set_shard_spec("weight", tp::ShardSpec::partitioned(0), group_);
///     }
///   };
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;

  /// The spec of parameter `name` (relative to this module), or replicated.
  ShardSpec shard_spec(const std::string& name) const;
  /// The group own parameters are split over (empty when none is).
  const Group& shard_group() const { return shard_group_; }
  /// Parameter names (relative to this module) with a non-default spec.
  const std::map<std::string, ShardSpec>& shard_specs() const { return specs_; }

 protected:
  void set_shard_spec(const std::string& name, const ShardSpec& spec, const Group& group);

 private:
  std::map<std::string, ShardSpec> specs_;
  Group shard_group_;
};

/// A parameter's layout and the group it is split over.
struct ParameterShard {
  ShardSpec spec;
  Group group;  // empty for parameters of modules that are not ShardedModule
};

/// The layout of every parameter of `module` and its descendants, by the
/// name named_parameters() gives it ("fc1.weight").
///
/// Example:
///   for (const auto& item : tp::shard_specs(*mlp)) std::cout << item.key() << ": " << item.value().spec << "\n";
torch::OrderedDict<std::string, ParameterShard> shard_specs(const torch::nn::Module& module);

/// The full (unsplit) state of `module`: parameters and buffers, partitioned
/// parameters gathered over their group. Collective over every group a
/// parameter is split over; every rank gets the full dict.
///
/// Example:
///   auto full = tp::gather_full_state_dict(*mlp);   // the same at any TP size
///   torch::save(...);
torch::OrderedDict<std::string, at::Tensor> gather_full_state_dict(const torch::nn::Module& module);

/// Loads a full state dict (from gather_full_state_dict() or an unsplit
/// model) into `module`, keeping this rank's shard of each partitioned
/// parameter. Local, no communication. Errors on a missing key or a shape
/// that does not match.
void load_full_state_dict(torch::nn::Module& module, const torch::OrderedDict<std::string, at::Tensor>& full);

/// Sums the gradients of parameters marked partial_grad (sequence-parallel
/// LayerNorm weights, row-parallel biases) across their tensor-parallel
/// group; call after backward, before the optimizer step (Megatron does it
/// when it finalises the gradients). Collective. Parameters without a
/// gradient contribute zeros.
///
/// Example:
///   loss.backward();
///   tp::allreduce_sequence_parallel_grads(*layer);
void allreduce_sequence_parallel_grads(torch::nn::Module& module);

}  // namespace commgrad::tp
