#pragma once
// Megatron's column- and row-parallel linear layers.
//
// Y = X A^T + b with A of shape [out, in]:
//   ColumnParallelLinear splits A by rows (output features): rank r holds
//     A_r [out/n, in] and b_r, and computes Y_r = X A_r^T + b_r, its slice of
//     the output features. Input: replicated X (or, under sequence
//     parallelism, X's chunk of the sequence, all-gathered first).
//   RowParallelLinear splits A by columns (input features): rank r holds
//     A_r [out, in/n] and computes the partial sum X_r A_r^T, reduced across
//     the group (all_reduce, or reduce_scatter along the sequence under
//     sequence parallelism); b is replicated and added once, after the
//     reduction.
// Column followed by Row (ParallelMLP) needs one all-reduce forward and one
// backward.
//
// Initialisation: a layer built from seed s draws the FULL weight (and bias)
// with a generator seeded with s, exactly as init_linear(in, out, bias, s)
// does, and keeps its shard, so TP = n starts from the exact shards of TP = 1.
// Without .seed(s) the seed is drawn from LibTorch's default CPU generator
// (the same on every rank of the group; see the options), so after
// torch::manual_seed(k) on every rank TP = n holds the shards of TP = 1.
// The distribution is torch::nn::Linear's: U(-1/sqrt(in), 1/sqrt(in)) for
// the weight and the bias, with `in` the full input size.
//
// Dtype: parameters are float32; move a layer with ->to(torch::kFloat64).

#include "commgrad/dist/group.h"
#include "commgrad/tp/sharding.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

namespace commgrad::tp {

/// The full (unsplit) parameters of a linear layer built from `seed`.
struct LinearWeights {
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // [out], undefined without bias
};

/// Draws the full weight (then the bias) of an in -> out linear layer from a
/// generator seeded with `seed`: what every parallel linear layer built from
/// `seed` holds a shard of. Load it into a torch::nn::Linear to get the
/// unsplit reference.
///
/// Example:
///   auto full = tp::init_linear(64, 256, true, 7);
///   torch::nn::Linear ref(64, 256);
///   torch::NoGradGuard no_grad;
///   ref->weight.copy_(full.weight); ref->bias.copy_(full.bias);
LinearWeights init_linear(int64_t in_features, int64_t out_features, bool bias, uint64_t seed);

/// at::linear(input, weight, bias), except that a forward under a
/// tp::DeferWeightGradients guard leaves the weight's gradient for W, as the
/// parallel linear layers do (tp/weight_gradients.h); the bias's gradient
/// comes in backward. For modules built of plain weights (moe::Experts).
///
/// Example:
///   auto y = tp::deferrable_linear(x, fc->weight, fc->bias);
at::Tensor deferrable_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias = {});

/// Output of forward_with_bias(): the layer output and, with skip_bias_add,
/// the bias the caller is to add (undefined otherwise).
struct LinearOutput {
  at::Tensor output;
  at::Tensor bias;
};

// ~~~ ColumnParallelLinear ~~~

/// Options of ColumnParallelLinear.
///
/// Example:
///   tp::ColumnParallelLinearOptions(1024, 4096, tp_group).bias(false).gather_output(true)
struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features, Group group = Group());
  /// Full input size.
  TORCH_ARG(int64_t, in_features);
  /// Full output size (divisible by the TP size * stride).
  TORCH_ARG(int64_t, out_features);
  /// Tensor-parallel group; empty: the current parallel state's.
  TORCH_ARG(Group, group);
  /// Learn an additive bias (split like the output features).
  TORCH_ARG(bool, bias) = true;
  /// All-gather the output features (Family 2 gather_from_tp_region), so the
  /// output is replicated; else each rank returns its slice [.., out/n].
  TORCH_ARG(bool, gather_output) = false;
  /// Return the bias to the caller (forward_with_bias) instead of adding it,
  /// so it can be fused with what follows.
  TORCH_ARG(bool, skip_bias_add) = false;
  /// Input is this rank's chunk of the sequence (dim 0), all-gathered before
  /// the matmul; backward reduce-scatters the input gradient. Needs
  /// gather_output(false).
  TORCH_ARG(bool, sequence_parallel) = false;
  /// Seed of the full-weight initialisation. Without one (the default) the
  /// layer draws a seed from LibTorch's default CPU generator, so two layers
  /// differ and torch::manual_seed() makes them reproducible; every rank of
  /// the group draws and takes group rank 0's draw (resolve_seed() in
  /// random.h: one broadcast), and options.seed() then holds it. With a seed
  /// nothing is drawn or communicated.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
  /// Blocks per rank of the output-feature split (3 for a fused QKV weight
  /// split by heads; see sharding.h).
  TORCH_ARG(int64_t, stride) = 1;
};

/// Linear layer with its output features split across the TP group.
///
/// forward(x): x is [.., in] (replicated), or [s/n, .., in] under sequence
/// parallelism; the result is [.., out/n] ([s, .., out/n] under sequence
/// parallelism), or [.., out] with gather_output.
///
/// Backward overlaps communication with compute: the input-gradient
/// all-reduce (reduce-scatter under sequence parallelism) starts as soon as
/// the input gradient is computed and runs while the weight gradient is
/// computed.
///
/// Example:
///   tp::ColumnParallelLinear fc(tp::ColumnParallelLinearOptions(1024, 4096, tp_group).seed(1));
///   auto h = fc(x);   // [tokens, 4096 / tp]
class ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl>, public ShardedModule {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features)
      : ColumnParallelLinearImpl(ColumnParallelLinearOptions(in_features, out_features)) {}
  explicit ColumnParallelLinearImpl(ColumnParallelLinearOptions options);

  void reset() override;
  /// Redraws the shard of the full initialisation from options.seed() (the
  /// seed given, or the one drawn when the layer was built: the same weights).
  void reset_parameters();
  /// "commgrad::tp::ColumnParallelLinear(in=1024, out=4096, tp=4, gather_output=false)".
  void pretty_print(std::ostream& stream) const override;

  at::Tensor forward(const at::Tensor& input);
  /// forward() that returns the bias separately when skip_bias_add is set.
  LinearOutput forward_with_bias(const at::Tensor& input);

  /// The options, with the group and the seed resolved.
  ColumnParallelLinearOptions options;
  /// This rank's rows of the weight, [out/n, in].
  at::Tensor weight;
  /// This rank's slice of the bias, [out/n]; undefined without bias.
  at::Tensor bias;
};
TORCH_MODULE(ColumnParallelLinear);

// ~~~ RowParallelLinear ~~~

/// Options of RowParallelLinear.
///
/// Example:
///   tp::RowParallelLinearOptions(4096, 1024, tp_group).input_is_parallel(true)
struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features, Group group = Group());
  /// Full input size (divisible by the TP size).
  TORCH_ARG(int64_t, in_features);
  /// Full output size.
  TORCH_ARG(int64_t, out_features);
  /// Tensor-parallel group; empty: the current parallel state's.
  TORCH_ARG(Group, group);
  /// Learn an additive bias (replicated, added once after the reduction).
  TORCH_ARG(bool, bias) = true;
  /// The input is already split along its last dim (the output of a
  /// ColumnParallelLinear); else it is replicated and split here
  /// (scatter_to_tp_region).
  TORCH_ARG(bool, input_is_parallel) = false;
  /// Return the bias to the caller (forward_with_bias) instead of adding it.
  TORCH_ARG(bool, skip_bias_add) = false;
  /// Reduce-scatter the output along dim 0 (the sequence) instead of
  /// all-reducing it; needs input_is_parallel. The bias gradient is then
  /// partial per rank (see allreduce_sequence_parallel_grads()).
  TORCH_ARG(bool, sequence_parallel) = false;
  /// Seed of the full-weight initialisation. Without one (the default) the
  /// layer draws a seed from LibTorch's default CPU generator, so two layers
  /// differ and torch::manual_seed() makes them reproducible; every rank of
  /// the group draws and takes group rank 0's draw (resolve_seed() in
  /// random.h: one broadcast), and options.seed() then holds it. With a seed
  /// nothing is drawn or communicated.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
};

/// Linear layer with its input features split across the TP group.
///
/// forward(x): x is [.., in/n] with input_is_parallel, else [.., in]
/// (replicated); the result is [.., out] (replicated), or [s/n, .., out]
/// under sequence parallelism.
///
/// Example:
///   tp::RowParallelLinear fc(tp::RowParallelLinearOptions(4096, 1024, tp_group).input_is_parallel(true));
///   auto y = fc(h);   // [tokens, 1024], identical on every TP rank
class RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl>, public ShardedModule {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features)
      : RowParallelLinearImpl(RowParallelLinearOptions(in_features, out_features)) {}
  explicit RowParallelLinearImpl(RowParallelLinearOptions options);

  void reset() override;
  /// Redraws the shard of the full initialisation from options.seed() (the
  /// seed given, or the one drawn when the layer was built: the same weights).
  void reset_parameters();
  /// "commgrad::tp::RowParallelLinear(in=4096, out=1024, tp=4, input_is_parallel=true)".
  void pretty_print(std::ostream& stream) const override;

  at::Tensor forward(const at::Tensor& input);
  /// forward() that returns the bias separately when skip_bias_add is set.
  LinearOutput forward_with_bias(const at::Tensor& input);

  /// The options, with the group and the seed resolved.
  RowParallelLinearOptions options;
  /// This rank's columns of the weight, [out, in/n].
  at::Tensor weight;
  /// The full bias, [out] (replicated); undefined without bias.
  at::Tensor bias;
};
TORCH_MODULE(RowParallelLinear);

namespace detail {

/// The linear map of ColumnParallelLinear without its bias: y = x w^T, with
/// the input gradient all-reduced (or, under sequence parallelism, x
/// all-gathered along dim 0 forward and its gradient reduce-scattered)
/// asynchronously, overlapped with the weight-gradient matmul.
at::Tensor column_parallel_matmul(const at::Tensor& input, const at::Tensor& weight, bool sequence_parallel,
                                  const Group& group);

}  // namespace detail
}  // namespace commgrad::tp
