#pragma once
// Megatron's tensor-parallel self-attention.
//
// Activations are [seq, batch, hidden] (Megatron's layout, so that sequence
// parallelism splits dim 0). The attention heads are split across the
// tensor-parallel group: with n ranks and H heads, rank r computes heads
// [r H/n, (r+1) H/n) end to end, with no communication between the QKV
// projection and the output projection:
//
//   qkv   ColumnParallelLinear(h -> 3h, stride 3): rank r holds the rows of
//         Q, K and V that belong to its heads ([Q_r; K_r; V_r]), so the
//         shard of each head is exactly that head's rows of the unsplit
//         layer's [Q; K; V] weight, whatever n is.
//   core  per head: softmax(Q K^T / sqrt(d) + causal mask) V, with attention
//         dropout drawn from the tensor-parallel RNG stream (tp/random.h).
//   dense RowParallelLinear(h -> h, input_is_parallel): sums the heads'
//         contributions across the group ("g"; a reduce-scatter along the
//         sequence under sequence parallelism).
//
// With context_parallel() the input holds this context-parallel rank's part
// of the sequence (cp/sequence.h) and the core attends across the
// context-parallel group (cp::attention: all-gather K/V, ring or Ulysses);
// heads are split over TP as before, so TP x CP (+ SP inside each CP part)
// composes.

#include "commgrad/cp/attention.h"
#include "commgrad/dist/group.h"
#include "commgrad/tp/linear.h"
#include "commgrad/tp/recompute.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

namespace commgrad::tp {

/// Options of ParallelSelfAttention (and of its reference, SelfAttentionReference
/// in reference.h, which ignores the group and sequence_parallel).
///
/// Example:
///   tp::ParallelSelfAttentionOptions(1024, 16, tp_group).attention_dropout(0.1).seed(3)
struct ParallelSelfAttentionOptions {
  ParallelSelfAttentionOptions(int64_t hidden_size, int64_t num_heads, Group group = Group());
  /// Model width h (divisible by num_heads; head size d = h / num_heads).
  TORCH_ARG(int64_t, hidden_size);
  /// Number of attention heads (divisible by the TP size).
  TORCH_ARG(int64_t, num_heads);
  /// Tensor-parallel group; empty: the current parallel state's.
  TORCH_ARG(Group, group);
  /// Biases in the QKV and output projections.
  TORCH_ARG(bool, bias) = true;
  /// Mask out attention to later positions (decoder self-attention).
  TORCH_ARG(bool, causal) = true;
  /// Dropout on the attention probabilities (tensor-parallel RNG stream).
  TORCH_ARG(double, attention_dropout) = 0.0;
  /// Input and output are this rank's chunk of the sequence (dim 0).
  TORCH_ARG(bool, sequence_parallel) = false;
  /// Selective recompute: the core (scores, softmax, dropout, P V) keeps no
  /// activation and runs again in backward (tp::recompute, the dropout mask
  /// replayed); it issues no collective, so none is re-issued (under
  /// context_parallel() it does: its K/V exchange runs again in backward).
  TORCH_ARG(bool, recompute_core) = false;
  /// qkv is initialised from `seed`, dense from `seed + 1` (see init_linear()).
  /// Without one (the default) the layer draws one seed from LibTorch's
  /// default CPU generator, the same on every rank of the group, as
  /// ColumnParallelLinearOptions::seed() describes; options.seed() then holds it.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
  /// Context parallelism: the input is this rank's part of the sequence
  /// (options.layout() of cp/sequence.h) and the core attends across
  /// options.group() by options.mode(); causal is this layer's. Errors with
  /// attention dropout, and under Ulysses when the heads of a TP rank do not
  /// divide by the CP size. nullopt (or a group of one): none.
  TORCH_ARG(std::optional<cp::ContextParallelOptions>, context_parallel) = std::nullopt;
};

/// Multi-head self-attention with the heads split across the TP group.
///
/// forward(x): x is [s, b, h], replicated on every TP rank, or this rank's
/// chunk [s/n, b, h] under sequence parallelism; the result has the same
/// shape and distribution. Errors (at construction) when num_heads is not
/// divisible by the TP size or hidden_size by num_heads.
///
/// Example:
///   tp::ParallelSelfAttention attn(tp::ParallelSelfAttentionOptions(1024, 16, tp_group).seed(3));
///   auto y = attn(x);   // [s, b, 1024]; rank r computed heads 16r/n .. 16(r+1)/n - 1
class ParallelSelfAttentionImpl : public torch::nn::Cloneable<ParallelSelfAttentionImpl> {
 public:
  ParallelSelfAttentionImpl(int64_t hidden_size, int64_t num_heads)
      : ParallelSelfAttentionImpl(ParallelSelfAttentionOptions(hidden_size, num_heads)) {}
  explicit ParallelSelfAttentionImpl(ParallelSelfAttentionOptions options);

  void reset() override;
  /// "commgrad::tp::ParallelSelfAttention(hidden=1024, heads=16, tp=4, causal=true)".
  void pretty_print(std::ostream& stream) const override;

  at::Tensor forward(const at::Tensor& input);

  /// Heads computed on this rank (num_heads / tp).
  int64_t num_local_heads() const;
  /// Size of one head (hidden_size / num_heads).
  int64_t head_dim() const;
  /// The attention core of this rank's heads: q, k, v [b, nh, s, d] ->
  /// context [s, b, nh * d] (no communication).
  at::Tensor core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

  /// True when the core attends across a context-parallel group of more than one rank.
  bool context_parallel() const;

  /// The options, with the group and the seed resolved.
  ParallelSelfAttentionOptions options;
  /// Fused Q, K, V projection of this rank's heads (h -> 3h/n).
  ColumnParallelLinear qkv{nullptr};
  /// Output projection (h/n -> h), reduced across the group.
  RowParallelLinear dense{nullptr};

 private:
  void check_context_parallel(const char* op, const Group& g) const;
};
TORCH_MODULE(ParallelSelfAttention);

}  // namespace commgrad::tp
