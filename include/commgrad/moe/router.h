#pragma once
// The top-k router of a mixture-of-experts layer (Switch / GShard / Mixtral):
// a gating linear h -> E without bias and a softmax over the E scores, both in
// at least float32 (16-bit logits tie and flip choices), the k largest per
// token, optionally renormalised to sum to 1. Or sigmoid scores (DeepSeek-V3,
// RoutingOptions::score_function): each expert's score is sigmoid(logit),
// independent of the others; P below then uses the scores normalised over the
// experts, s_i / sum_j s_j.
//
// Load balancing (Switch Transformer, Fedus et al. 2021, eq. 4), with the
// normalisation stated:
//
//   aux = coeff * E * sum_i f_i * P_i
//   f_i = (assignments of tokens to expert i) / (T_B * k)     over the batch group
//   P_i = (1 / T_r) * sum_{t on this rank} softmax(logits_t)_i
//
// f counts every token of `batch_group` (one all_reduce of E + 1 integers:
// the counts and T_B; f carries no gradient, as in Switch), P is the mean
// over this rank's own T_r tokens. So each rank's aux is normalised the way
// its main loss is (the mean over its own tokens, which data parallelism then
// averages over the ranks): the mean of the ranks' aux over the batch group
// (weighted by their token counts when these differ) is the aux the one-rank
// layer computes over the union of their tokens, and so are the averaged
// gradients. Uniform routing gives aux = coeff.
//
// z-loss (ST-MoE, Zoph et al. 2022): z = coeff_z * mean_t (logsumexp_t)^2,
// over this rank's tokens.
//
// Both losses are injected into backward without changing the forward
// (Megatron's MoEAuxLossAutoScaler): attach_loss(probs, loss) returns probs;
// its backward passes the gradient through and gives `loss` the gradient
// `scale` (1 by default; 1/M when a pipeline averages M microbatches). The
// values stay readable for logging (RouterOutput).

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace commgrad::moe {

/// How the router turns logits into scores.
enum class ScoreFunction {
  kSoftmax,  ///< softmax over the E logits (Switch, GShard, Mixtral; the default)
  kSigmoid,  ///< sigmoid of each logit (DeepSeek-V3): experts scored independently
};

/// "softmax" or "sigmoid".
const char* score_function_name(ScoreFunction f);

/// How tokens pick experts and how balance is encouraged (MoELayerOptions::routing).
///
/// Example:
///   moe::RoutingOptions().aux_loss_coeff(1e-2).normalize_top_k(true).batch_group(dp_group)
struct RoutingOptions {
  /// Softmax or sigmoid scores. With sigmoid the top-k scores are the
  /// combine weights (normalize_top_k(true) divides them by their sum, as
  /// DeepSeek-V3 does), and the balancing loss's P takes each token's scores
  /// normalised to sum to 1 over the E experts (s_i / sum_j s_j, DeepSeek-V3's
  /// sequence-wise loss), so uniform routing still gives aux = coeff.
  TORCH_ARG(ScoreFunction, score_function) = ScoreFunction::kSoftmax;
  /// Renormalise each token's k probabilities to sum to 1 (Mixtral); off:
  /// the softmax probabilities themselves (Switch, GShard).
  TORCH_ARG(bool, normalize_top_k) = false;
  /// Coefficient of the switch load-balancing loss (0: none).
  TORCH_ARG(double, aux_loss_coeff) = 0.0;
  /// Coefficient of the router z-loss (0: none).
  TORCH_ARG(double, z_loss_coeff) = 0.0;
  /// The ranks whose tokens form the batch the expert counts f are taken
  /// over (the data x context group for the whole batch). Undefined: the
  /// layer's expert-parallel group (the router's own group when alone).
  TORCH_ARG(Group, batch_group);
  /// The input is [s, b, h] and the balancing loss is taken per sequence
  /// (f and P over each sequence's s tokens, then the mean over the b
  /// sequences; Megatron's seq_aux_loss). No communication, and the loss no
  /// longer depends on how sequences are grouped into microbatches and data-
  /// parallel ranks: a model trains the same at every layout (the GPT does).
  TORCH_ARG(bool, aux_loss_per_sequence) = false;
  /// With aux_loss_per_sequence: the ranks that hold the other parts of each
  /// sequence and whose losses are averaged (context parallelism; undefined:
  /// the installed layout's context-parallel group when it has more than
  /// one rank, else none). The counts f are summed over them (one all-reduce of b x E
  /// int64) and P stays the mean over this rank's tokens, so the ranks'
  /// losses averaged over the group (as the reducers average their
  /// gradients) are the whole sequence's.
  TORCH_ARG(Group, context_parallel_group);
  /// Aux-loss-free balancing (DeepSeek-V3): > 0 chooses experts by score +
  /// expert_bias (a buffer: no gradient; the combine weights stay the
  /// scores), and update_expert_bias() moves each bias by this rate toward
  /// balance. 0: no bias.
  TORCH_ARG(double, expert_bias_rate) = 0.0;
};

/// Options of TopKRouter.
///
/// Example:
///   moe::TopKRouterOptions(1024, 8, 2).routing(moe::RoutingOptions().aux_loss_coeff(1e-2)).seed(3)
struct TopKRouterOptions {
  TopKRouterOptions(int64_t hidden_size, int64_t num_experts, int64_t top_k)
      : hidden_size_(hidden_size), num_experts_(num_experts), top_k_(top_k) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(int64_t, num_experts);
  /// Experts per token, 1 <= k <= num_experts.
  TORCH_ARG(int64_t, top_k);
  TORCH_ARG(RoutingOptions, routing);
  /// The ranks that split each sequence of the input (Megatron's sequence
  /// parallelism: the TP group; undefined: none). Each rank routes its own
  /// shard of every sequence (the shards equal in size; the group orthogonal
  /// to the batch group) and the ranks hold one replicated loss (Family 2),
  /// so what a rank computes is its part of the unsplit router's: the gating
  /// weight's gradient is summed over the group in backward
  /// (tp::copy_to_tp_region), the counts f of the balancing loss are summed
  /// over it, P is taken over the whole sequence (or batch), and the z-loss's
  /// mean counts the group's tokens. The losses summed over the group are
  /// the unsplit router's (each rank's RouterOutput holds its part).
  TORCH_ARG(Group, sequence_parallel_group);
  /// The gating weight is init_linear(hidden, experts, false, seed).weight;
  /// without one, drawn as tp layers draw theirs (the same on every rank
  /// of batch_group).
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
};

/// What the router decided for this rank's tokens.
struct RouterOutput {
  at::Tensor logits;    ///< [T, E], the gating linear's output (at least float32)
  at::Tensor probs;     ///< [T, k], combine weights (input dtype), carrying the injected losses
  at::Tensor experts;   ///< [T, k] int64, the chosen experts, by decreasing probability
  at::Tensor aux_loss;  ///< this rank's load-balancing loss (detached; 0 when off)
  at::Tensor z_loss;    ///< this rank's z-loss (detached; 0 when off)
};

/// Gating linear + top-k over softmax, with the balancing losses injected
/// into backward (see the file comment).
///
/// Example:
///   moe::TopKRouter router(moe::TopKRouterOptions(64, 4, 2).seed(1));
///   auto r = router(x);     // x [T, 64]: r.experts [T, 2], r.probs [T, 2]
class TopKRouterImpl : public torch::nn::Cloneable<TopKRouterImpl> {
 public:
  explicit TopKRouterImpl(TopKRouterOptions options);
  void reset() override;
  /// "commgrad::moe::TopKRouter(hidden=64, experts=4, top_k=2, aux_loss_coeff=0.01)".
  void pretty_print(std::ostream& stream) const override;

  /// x: [T, hidden] (T may be 0); with aux_loss_per_sequence, T = s * b
  /// tokens of `sequences` = b sequences, token i * b + j of sequence j.
  /// Collective over routing().batch_group() when aux_loss_coeff > 0 (and
  /// not per sequence).
  RouterOutput forward(const at::Tensor& x, int64_t sequences = 1);

  /// The gradient the injected losses receive in backward (1 by default;
  /// 1/M when the caller's backward averages M microbatches, as
  /// pp::Pipeline does).
  double loss_scale = 1.0;

  /// With expert_bias_rate > 0: b_i += rate * sign(mean load - load_i), the
  /// loads counted since the last update over the batch group and the
  /// sequence-parallel group (collective over them), so every rank's bias
  /// stays the same. Call it after each
  /// optimizer step.
  void update_expert_bias();

  /// The options, with the batch group and the seed resolved.
  TopKRouterOptions options;
  at::Tensor weight;       ///< [E, hidden]
  at::Tensor expert_bias;  ///< [E] float32 buffer, with expert_bias_rate > 0

 private:
  std::tuple<at::Tensor, at::Tensor> choose(const at::Tensor& scores, int64_t k);
  at::Tensor load_;  // pairs per expert since the last update_expert_bias()
};
TORCH_MODULE(TopKRouter);

/// Sets TopKRouterImpl::loss_scale of every router inside `module` (1/M
/// when the caller's backward averages M microbatches). Under dynamic loss
/// scaling the injected losses must be scaled like the main loss, or the
/// unscale divides their gradients by S: set S/M before each step's
/// backward (Megatron's MoEAuxLossAutoScaler.set_loss_scale does the same).
///
/// Example:
///   moe::set_aux_loss_scale(*model, 1.0 / microbatches);
///   moe::set_aux_loss_scale(*model, scaler.scale() / microbatches);   // fp16 with optim::DynamicLossScaler
void set_aux_loss_scale(torch::nn::Module& module, double scale);

/// TopKRouterImpl::update_expert_bias() of every router with a bias inside `module`.
///
/// Example:
///   zero.step();
///   moe::update_expert_bias(*model);
void update_expert_bias(torch::nn::Module& module);

/// Returns a copy of x; in backward x's gradient
/// passes through and `loss` (a scalar) receives the gradient `scale`.
/// So loss joins the objective without being added to it in forward.
///
/// Example:
///   probs = moe::attach_loss(probs, aux_loss, 1.0);
at::Tensor attach_loss(const at::Tensor& x, const at::Tensor& loss, double scale = 1.0);

/// The switch load-balancing loss of the file comment from explicit parts:
/// scores [T, E] (softmax, differentiable), counts [E] (assignments over
/// the batch), batch_tokens T_B. coeff * E * sum_i counts_i / (T_B k) * mean_t scores_ti.
///
/// Example:
///   auto aux = moe::switch_load_balancing_loss(at::softmax(logits, -1), counts, 28, 2, 1e-2);
at::Tensor switch_load_balancing_loss(const at::Tensor& scores, const at::Tensor& counts, int64_t batch_tokens,
                                      int64_t top_k, double coeff);

}  // namespace commgrad::moe
