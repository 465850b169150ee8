#pragma once
// The Megatron feed-forward block: ColumnParallelLinear -> GELU ->
// RowParallelLinear.
//
// The hidden activation stays split across the TP group (each rank holds
// ffn/n of its features), so the block communicates once forward (the row
// layer's all-reduce, "g") and once backward (the column layer's input-
// gradient all-reduce, "f"). Under sequence parallelism these become an
// all-gather + reduce-scatter pair forward and backward.

#include "commgrad/dist/group.h"
#include "commgrad/tp/linear.h"
#include "commgrad/tp/sharding.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

namespace commgrad::tp {

/// Options of ParallelMLP.
///
/// Example:
///   tp::ParallelMLPOptions(1024, 4096, tp_group).seed(42)
struct ParallelMLPOptions {
  ParallelMLPOptions(int64_t hidden_size, int64_t ffn_hidden_size, Group group = Group());
  /// Model width (input and output size).
  TORCH_ARG(int64_t, hidden_size);
  /// Width of the hidden activation (divisible by the TP size).
  TORCH_ARG(int64_t, ffn_hidden_size);
  /// Tensor-parallel group; empty: the current parallel state's.
  TORCH_ARG(Group, group);
  /// Biases in both linear layers.
  TORCH_ARG(bool, bias) = true;
  /// Input and output are this rank's chunk of the sequence (dim 0).
  TORCH_ARG(bool, sequence_parallel) = false;
  /// fc1 is initialised from `seed`, fc2 from `seed + 1` (see init_linear()).
  /// Without one (the default) the block draws one seed from LibTorch's
  /// default CPU generator, the same on every rank of the group, as
  /// ColumnParallelLinearOptions::seed() describes; options.seed() then holds it.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
};

/// y = fc2(gelu(fc1(x))), fc1 column-parallel, fc2 row-parallel. Its
/// unsplit reference (MLPReference, reference.h) is two torch::nn::Linear
/// layers named fc1 and fc2 built from init_linear(h, ffn, bias, seed) and
/// init_linear(ffn, h, bias, seed + 1) with exact (erf) GELU between them.
///
/// Example:
///   tp::ParallelMLP mlp(tp::ParallelMLPOptions(1024, 4096, tp_group).seed(42));
///   auto y = mlp(x);   // [tokens, 1024] in and out, identical on every TP rank
class ParallelMLPImpl : public torch::nn::Cloneable<ParallelMLPImpl> {
 public:
  ParallelMLPImpl(int64_t hidden_size, int64_t ffn_hidden_size)
      : ParallelMLPImpl(ParallelMLPOptions(hidden_size, ffn_hidden_size)) {}
  explicit ParallelMLPImpl(ParallelMLPOptions options);

  void reset() override;
  /// "commgrad::tp::ParallelMLP(hidden=1024, ffn=4096, tp=4)".
  void pretty_print(std::ostream& stream) const override;

  at::Tensor forward(const at::Tensor& input);

  /// The options, with the group and the seed resolved.
  ParallelMLPOptions options;
  ColumnParallelLinear fc1{nullptr};
  RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(ParallelMLP);

}  // namespace commgrad::tp
