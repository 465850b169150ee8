#pragma once
// The mixture-of-experts block: router, token dispatch over the expert-
// parallel group, this rank's experts, and the combine (docs/moe.md).
//
//   r   = router(x)                          x: this rank's tokens [..., h]
//   d   = dispatch(x, r.experts, keep)       rows to the ranks of their experts
//   y_e = experts(d.tokens)                  loop over the local experts
//   out = combine(y_e, r.probs)              sum_j p_tj * expert_{e_tj}(x_t)
//
// Gradient convention (the Family 1 rule of docs/design.md): each rank's
// loss is the mean over its own tokens, and the objective is the mean of the
// ranks' losses over the data x context group, the same as the one-rank
// layer's mean over the union of their tokens. The all-to-all's backward
// brings every token's gradient back to the expert that saw it, so after
// backward an expert's gradient is the sum over the ranks of its expert-
// parallel group of their losses' gradients: not scaled by any group size.
// The reducers then divide every gradient by the data x context size:
// dense parameters (router, attention, ...) are averaged over the data x
// context group, expert parameters are SUMMED over the expert-data-parallel
// group and divided by the data x context size (which is ep times the
// expert-data size); averaging them over the expert-data group alone would
// make them ep times too large (Megatron PR#5956). See expert_data_parallel.h.
//
// Sequence parallelism (sequence_parallel_group: Megatron's SP, the TP
// group): each rank of the group holds a shard of every sequence and the
// ranks hold one replicated loss (Family 2). Each routes and dispatches its
// own tokens over its expert-parallel group, to experts that are the same on
// every rank of the sequence-parallel group (expert TP size 1): the group
// acts as more data-parallel ranks for the experts. A rank's router and
// expert gradients then cover only its tokens, so their parameters enter
// forward through tp::copy_to_tp_region, whose backward sums them over the
// group: after backward they are what the unsplit layer gives, the same on
// every rank of the group, and the reducers treat them as without SP (dense:
// averaged over data x context; experts: summed over the expert-data group,
// divided by the data x context size). The balancing losses count the whole
// sequence (router.h).
//
// Dropless by default: every (token, choice) pair reaches its expert. With
// a capacity factor c each expert takes at most ceil(c T k / E) of this
// rank's pairs (T: this rank's tokens), chosen by the drop policy; a token
// whose pairs are all dropped gets zeros (the residual around the block
// carries it). The capacity is a rank-local decision, so the same pairs are
// dropped at every ep.

#include "commgrad/dist/group.h"
#include "commgrad/moe/experts.h"
#include "commgrad/moe/router.h"
#include "commgrad/moe/token_dispatcher.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

namespace commgrad::moe {

/// How tokens travel to the experts.
enum class DispatcherType {
  kAllToAll,   ///< counts + rows by all-to-all (the default)
  kAllGather,  ///< every rank gathers every token (comparison, small groups; equal T per rank)
};

/// Options of MoELayer.
///
/// Example:
///   moe::MoELayerOptions(64, 128, 8, 2, ep_group)
///       .routing(moe::RoutingOptions().aux_loss_coeff(1e-2).batch_group(dp_group))
///       .seed(5)
struct MoELayerOptions {
  MoELayerOptions(int64_t hidden_size, int64_t ffn_hidden_size, int64_t num_experts, int64_t top_k,
                  Group group = Group())
      : hidden_size_(hidden_size),
        ffn_hidden_size_(ffn_hidden_size),
        num_experts_(num_experts),
        top_k_(top_k),
        group_(std::move(group)) {}
  TORCH_ARG(int64_t, hidden_size);
  /// Width of each expert's hidden activation.
  TORCH_ARG(int64_t, ffn_hidden_size);
  /// Experts of the layer (divisible by the expert-parallel size).
  TORCH_ARG(int64_t, num_experts);
  /// Experts per token.
  TORCH_ARG(int64_t, top_k);
  /// The expert-parallel group. Undefined: the current layout's
  /// (commgrad::expert_parallel_group()), or this rank alone without one.
  TORCH_ARG(Group, group);
  /// Score normalisation, balancing losses and the group they count over.
  TORCH_ARG(RoutingOptions, routing);
  /// 0: dropless (default); c > 0: at most ceil(c T k / E) pairs per expert.
  TORCH_ARG(double, capacity_factor) = 0.0;
  TORCH_ARG(DropPolicy, drop_policy) = DropPolicy::kProbability;
  TORCH_ARG(DispatcherType, dispatcher) = DispatcherType::kAllToAll;
  /// Sequence parallelism: the ranks that split each sequence of the input
  /// (the TP group; undefined: none; see the file comment). Each rank
  /// routes and dispatches its own shard; the router's and the experts'
  /// gradients are summed over the group in backward.
  TORCH_ARG(Group, sequence_parallel_group);
  /// The router from `seed`, expert e from seed + 1 + 2e and seed + 2 + 2e
  /// (ExpertsOptions::seed); without one, drawn the same on every rank of
  /// the group (tp::resolve_seed).
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
};

/// A mixture-of-experts feed-forward block over an expert-parallel group.
///
/// forward(x): x [..., hidden], this rank's tokens (any number, 0 included);
/// the result has x's shape. Collective over the group (and the routing's
/// batch group with an aux loss).
///
/// Example:
///   moe::MoELayer layer(moe::MoELayerOptions(64, 128, 4, 2, ep_group).seed(1));
///   auto y = layer(x);                  // [7, 64] -> [7, 64]
///   y.mean().backward();                // the aux loss's gradient is in there too
class MoELayerImpl : public torch::nn::Cloneable<MoELayerImpl> {
 public:
  explicit MoELayerImpl(MoELayerOptions options);
  void reset() override;
  /// "commgrad::moe::MoELayer(hidden=64, ffn=128, experts=4, top_k=2, ep=2)".
  void pretty_print(std::ostream& stream) const override;

  at::Tensor forward(const at::Tensor& x);

  /// The router's decisions of the last forward (detached): logits, probs,
  /// experts, aux and z losses.
  const RouterOutput& last_routing() const { return last_; }
  /// The expert-sorted rows of the last forward's dispatch, per local expert.
  const std::vector<int64_t>& last_tokens_per_expert() const { return last_tokens_per_expert_; }

  /// The options, with the group and the seed resolved.
  MoELayerOptions options;
  TopKRouter router{nullptr};
  Experts experts{nullptr};

 private:
  RouterOutput last_;
  std::vector<int64_t> last_tokens_per_expert_;
};
TORCH_MODULE(MoELayer);

}  // namespace commgrad::moe
