#pragma once
// Unsplit, single-rank references of the tensor-parallel layers, built from
// plain torch::nn modules and the same options (and seeds) as the parallel
// layers they check: what a parallel layer computes at any TP size, written
// without any communication. Their parameter names match the parallel
// layers', so the gradient checker (commgrad/check.h) pairs them by name.
//
//   init_reference_linear    a torch::nn::Linear loaded with init_linear()
//   MLPReference             of ParallelMLP (mlp.h)
//   SelfAttentionReference   of ParallelSelfAttention (attention.h)
//   TransformerLayerReference of ParallelTransformerLayer (transformer_layer.h)
//
// Seeds: the options' seed when given. Without one a reference draws one
// seed with draw_seed() (random.h) before building anything, as its parallel
// layer does, so after torch::manual_seed(k) a reference built without a
// seed holds the parameters of the parallel layer built without one at any
// TP size after torch::manual_seed(k) on every rank. (The reference's own
// torch::nn::Linear layers then draw their default initialisation, which is
// overwritten, so the generator ends up further on than after the parallel
// layer.) options.seed() then holds the seed.

#include "commgrad/tp/attention.h"
#include "commgrad/tp/mlp.h"
#include "commgrad/tp/transformer_layer.h"

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

namespace commgrad::tp {

/// Overwrites the parameters of `linear` with init_linear(in, out, bias,
/// seed): the unsplit counterpart of a parallel linear layer built from
/// `seed` (the building block of the references).
///
/// Example:
///   torch::nn::Linear fc1(64, 256);
///   tp::init_reference_linear(fc1, 7);   // == the full ColumnParallelLinear(64, 256).seed(7)
void init_reference_linear(torch::nn::Linear& linear, uint64_t seed);

/// The unsplit reference of ParallelMLP: torch::nn::Linear fc1 and fc2 built
/// from init_linear(h, ffn, bias, seed) and init_linear(ffn, h, bias, seed + 1)
/// with exact (erf) GELU between them.
///
/// Example:
///   tp::MLPReference ref(tp::ParallelMLPOptions(1024, 4096).seed(42));
class MLPReferenceImpl : public torch::nn::Cloneable<MLPReferenceImpl> {
 public:
  explicit MLPReferenceImpl(ParallelMLPOptions options);
  void reset() override;
  /// "commgrad::tp::MLPReference(hidden=1024, ffn=4096)".
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& input);

  /// The options, with the seed resolved.
  ParallelMLPOptions options;
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(MLPReference);

/// The unsplit, single-rank reference of ParallelSelfAttention: plain
/// torch::nn::Linear layers `qkv` (h -> 3h, output [Q | K | V]) and `dense`
/// loaded with init_linear(h, 3h, bias, seed) and init_linear(h, h, bias,
/// seed + 1), and the textbook attention math. Its parameter names match the
/// parallel module's, so the gradient checker pairs them by name. Attention
/// dropout draws from the current stream of rng_tracker().
///
/// Example:
///   tp::SelfAttentionReference ref(tp::ParallelSelfAttentionOptions(1024, 16).seed(3));
///   auto y = ref(x);   // what ParallelSelfAttention computes at any TP size
class SelfAttentionReferenceImpl : public torch::nn::Cloneable<SelfAttentionReferenceImpl> {
 public:
  explicit SelfAttentionReferenceImpl(ParallelSelfAttentionOptions options);

  void reset() override;
  /// "commgrad::tp::SelfAttentionReference(hidden=1024, heads=16, causal=true)".
  void pretty_print(std::ostream& stream) const override;

  /// x: [s, b, h] -> [s, b, h].
  at::Tensor forward(const at::Tensor& input);

  /// The options, with the seed resolved.
  ParallelSelfAttentionOptions options;
  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear dense{nullptr};
};
TORCH_MODULE(SelfAttentionReference);

/// The unsplit reference of ParallelTransformerLayer, built from the same
/// options (and seed) out of torch::nn layers, SelfAttentionReference and
/// MLPReference; parameter names match the parallel layer's. Dropout draws
/// from the current stream of rng_tracker().
///
/// Example:
///   tp::TransformerLayerReference ref(tp::ParallelTransformerLayerOptions(1024, 16, 4096).seed(5));
///   auto z = ref(x);   // [s, b, h]
class TransformerLayerReferenceImpl : public torch::nn::Cloneable<TransformerLayerReferenceImpl> {
 public:
  explicit TransformerLayerReferenceImpl(ParallelTransformerLayerOptions options);
  void reset() override;
  /// "commgrad::tp::TransformerLayerReference(hidden=1024, heads=16, ffn=4096)".
  void pretty_print(std::ostream& stream) const override;
  /// x: [s, b, h] -> [s, b, h].
  at::Tensor forward(const at::Tensor& input);

  /// The options, with the seed resolved.
  ParallelTransformerLayerOptions options;
  torch::nn::LayerNorm ln1{nullptr};
  SelfAttentionReference attention{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  MLPReference mlp{nullptr};
};
TORCH_MODULE(TransformerLayerReference);

}  // namespace commgrad::tp
