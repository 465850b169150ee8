#pragma once
// Megatron's tensor-parallel transformer layer (pre-LayerNorm GPT block), with
// or without sequence parallelism.
//
//   y = x + dropout(attention(ln1(x)))
//   z = y + dropout(mlp(ln2(y)))
//
// Without sequence parallelism the residual stream [s, b, h] is replicated on
// every TP rank, and so is everything outside attention and MLP (LayerNorms,
// residual adds, hidden dropout from the replicated RNG stream).
//
// With sequence parallelism (Korthikanti et al., 2022) the residual stream
// is split along the sequence: rank r holds [s/n, b, h], the LayerNorms and
// dropouts run on that chunk only (dropout from the tensor-parallel stream),
// and the all-reduces of attention and MLP become an all-gather before the
// column layer and a reduce-scatter after the row layer: the same traffic,
// 1/n of the activation memory outside the TP regions. The LayerNorm
// parameters (and the row layers' biases) stay replicated, but each rank's
// gradient then covers only its chunk of the sequence: those gradients MUST
// be summed over the TP group after backward with
// allreduce_sequence_parallel_grads() (sharding.h), or the replicas diverge.

#include "commgrad/dist/group.h"
#include "commgrad/tp/attention.h"
#include "commgrad/tp/mlp.h"
#include "commgrad/tp/recompute.h"
#include "commgrad/tp/sharding.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace commgrad::tp {

/// Options of ParallelTransformerLayer (and of TransformerLayerReference in
/// reference.h, which ignores the group and sequence_parallel).
///
/// Example:
///   tp::ParallelTransformerLayerOptions(1024, 16, 4096, tp_group).sequence_parallel(true).seed(5)
struct ParallelTransformerLayerOptions {
  ParallelTransformerLayerOptions(int64_t hidden_size, int64_t num_heads, int64_t ffn_hidden_size,
                                  Group group = Group());
  /// Model width h.
  TORCH_ARG(int64_t, hidden_size);
  /// Attention heads (divisible by the TP size; h divisible by it).
  TORCH_ARG(int64_t, num_heads);
  /// MLP width (divisible by the TP size).
  TORCH_ARG(int64_t, ffn_hidden_size);
  /// Tensor-parallel group; empty: the current parallel state's.
  TORCH_ARG(Group, group);
  /// Dropout after attention and after the MLP, before each residual add.
  TORCH_ARG(double, hidden_dropout) = 0.0;
  /// Dropout on the attention probabilities.
  TORCH_ARG(double, attention_dropout) = 0.0;
  /// Residual stream split along the sequence (dim 0) across the TP group.
  TORCH_ARG(bool, sequence_parallel) = false;
  /// LayerNorm epsilon.
  TORCH_ARG(double, layernorm_eps) = 1e-5;
  /// Activation recomputation in training: kSelective recomputes the
  /// attention core (no collective re-issued, except the core's own under
  /// context parallelism); kFull keeps only the layer's
  /// input and reruns the whole layer in backward, collectives included
  /// (2 per layer without sequence parallelism, 4 with it). Dropout masks are
  /// replayed: gradients equal those without recompute.
  TORCH_ARG(RecomputeGranularity, recompute) = RecomputeGranularity::kNone;
  /// attention from `seed` (qkv `seed`, dense `seed + 1`), mlp from
  /// `seed + 2` (fc1 `seed + 2`, fc2 `seed + 3`); LayerNorms start at 1 and 0.
  /// Without one (the default) the layer draws one seed from LibTorch's
  /// default CPU generator, the same on every rank of the group, as
  /// ColumnParallelLinearOptions::seed() describes; options.seed() then holds it.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
  /// Context parallelism of the attention (ParallelSelfAttentionOptions::context_parallel).
  TORCH_ARG(std::optional<cp::ContextParallelOptions>, context_parallel) = std::nullopt;
  /// Builds the feed-forward block in place of ParallelMLP (e.g. a
  /// moe::MoELayer), from these options with the group and seed resolved:
  /// [s, b, h] in and out, registered as "mlp". Null (the default): ParallelMLP.
  TORCH_ARG(std::function<torch::nn::AnyModule(const ParallelTransformerLayerOptions&)>, feed_forward) = nullptr;
};

/// Pre-LayerNorm transformer layer over the TP group: ln1, ParallelSelfAttention,
/// residual, ln2, ParallelMLP, residual.
///
/// forward(x): x is [s, b, h] replicated, or this rank's chunk [s/n, b, h]
/// under sequence parallelism; the result has the same shape and distribution.
/// Dropout needs the tensor-parallel stream of rng_tracker() (seed it with
/// model_parallel_manual_seed()).
///
/// Example:
///   tp::model_parallel_manual_seed(1234, tp_group);
///   tp::ParallelTransformerLayer layer(
///       tp::ParallelTransformerLayerOptions(1024, 16, 4096, tp_group).sequence_parallel(true));
///   auto chunk = tp::scatter_to_sequence_parallel_region(x, tp_group);   // [s/n, b, h]
///   auto y = layer(chunk);
///   y.sum().backward();
///   tp::allreduce_sequence_parallel_grads(*layer);   // LayerNorm and row-bias grads
class ParallelTransformerLayerImpl : public torch::nn::Cloneable<ParallelTransformerLayerImpl>, public ShardedModule {
 public:
  ParallelTransformerLayerImpl(int64_t hidden_size, int64_t num_heads, int64_t ffn_hidden_size)
      : ParallelTransformerLayerImpl(ParallelTransformerLayerOptions(hidden_size, num_heads, ffn_hidden_size)) {}
  explicit ParallelTransformerLayerImpl(ParallelTransformerLayerOptions options);

  void reset() override;
  /// "commgrad::tp::ParallelTransformerLayer(hidden=1024, heads=16, ffn=4096, tp=4, sequence_parallel=true)".
  void pretty_print(std::ostream& stream) const override;

  at::Tensor forward(const at::Tensor& input);

  /// The options, with the group and the seed resolved.
  ParallelTransformerLayerOptions options;
  torch::nn::LayerNorm ln1{nullptr};
  ParallelSelfAttention attention{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  ParallelMLP mlp{nullptr};
  /// The block options.feed_forward() built (then mlp is null).
  torch::nn::AnyModule feed_forward;

 private:
  at::Tensor forward_layer(const at::Tensor& input);
};
TORCH_MODULE(ParallelTransformerLayer);

}  // namespace commgrad::tp
