#pragma once
// Token dispatch over an expert-parallel group: every (token, choice) pair
// goes to the rank that holds its expert, arrives sorted by local expert,
// and its expert's output comes back to be weighted by the router's
// probability and summed per token.
//
// all_to_all_dispatch:
//   1. the kept pairs, sorted by expert (stable: by token within an
//      expert). Experts of rank r are [r E/ep, (r+1) E/ep), so this is also
//      sorted by destination rank: input_splits[r] = pairs for rank r.
//   2. the counts per expert [E] exchanged by one raw all_to_all (int64,
//      no gradient): rank r learns how many rows each rank sends to each
//      of its local experts, hence output_splits.
//   3. the token rows by ops::all_to_all with those splits (differentiable:
//      backward is the all_to_all with the splits swapped). Zero-size parts
//      and ranks that send or receive nothing are normal.
//   4. the received rows, which come by source rank, regrouped by local
//      expert (one index_select).
// all_to_all_combine undoes 4 and 3 (the gradient of the experts' inputs
// travels back through 3's backward), multiplies each pair's row by its
// probability and index_adds the pairs of each token, in expert order.
//
// Bytes moved per rank and direction: the rows it sends to other ranks,
// sum_{r != me} input_splits[r] * h * itemsize, once forward for dispatch,
// once for combine, and the same twice in backward; plus E int64 counts.
//
// all_gather_dispatch is the comparison (and small-group) form: every rank
// all-gathers every rank's tokens and choices, runs its local experts on the
// pairs that chose them, and the combined outputs are reduce-scattered back
// (ops::reduce_scatter; backward all_gather). It moves ep times more rows
// and needs equal token counts on every rank; outputs and gradients equal the
// all-to-all form's.

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace commgrad::moe {

/// Which of an expert's pairs are kept when more than its capacity chose it.
enum class DropPolicy {
  kProbability,  ///< the pairs with the highest router probability (ties: by position)
  kPosition,     ///< the first pairs in token order (token t, choice j at t * k + j)
};

/// "probability" or "position".
///
/// Example:
///   std::cout << moe::drop_policy_name(moe::DropPolicy::kPosition);   // position
const char* drop_policy_name(DropPolicy policy);

/// The pairs [T, k] (bool) each expert keeps when it takes at most
/// `capacity` of this rank's pairs, chosen by `policy`. experts and probs
/// are the router's [T, k] outputs.
///
/// Example:
///   auto keep = moe::capacity_mask(r.experts, r.probs, 4, moe::expert_capacity(1.25, T, 2, 4),
///                                  moe::DropPolicy::kProbability);
at::Tensor capacity_mask(const at::Tensor& experts, const at::Tensor& probs, int64_t num_experts, int64_t capacity,
                         DropPolicy policy);

/// ceil(capacity_factor * tokens * top_k / num_experts): pairs per expert
/// and rank (Megatron's get_capacity).
///
/// Example:
///   moe::expert_capacity(1.25, 512, 2, 8)   // 160
int64_t expert_capacity(double capacity_factor, int64_t tokens, int64_t top_k, int64_t num_experts);

/// What combine needs to know of a dispatch.
struct DispatchPlan {
  int64_t tokens = 0;  ///< T, this rank's tokens
  int64_t top_k = 1;
  at::Tensor order;                        ///< [A] int64: flat pair index t * k + j, kept pairs by expert
  at::Tensor token_of;                     ///< [A] int64: order / k
  std::vector<int64_t> input_splits;       ///< rows sent to each rank
  std::vector<int64_t> output_splits;      ///< rows received from each rank
  at::Tensor regroup;                      ///< [R] received row of each expert-sorted row
  std::vector<int64_t> tokens_per_expert;  ///< R split by local expert
  bool all_gather = false;                 ///< made by all_gather_dispatch
  at::Tensor gathered_token_of;            ///< all_gather: token (of the gathered batch) of each row
  at::Tensor gathered_pair_of;             ///< all_gather: pair (of the gathered batch) of each row
};

/// This rank's expert inputs and the plan to send their outputs back.
struct Dispatched {
  at::Tensor tokens;  ///< [R, h], by local expert (plan.tokens_per_expert rows each)
  DispatchPlan plan;
};

/// Sends the rows of x [T, h] to the ranks of their experts (steps 1-4 of
/// the file comment). experts: [T, k] int64 in [0, num_experts); keep:
/// [T, k] bool, or undefined for all (dropless). Collective over `group`.
///
/// Example:
///   auto d = moe::all_to_all_dispatch(x, r.experts, {}, 8, ep_group);
///   auto y = experts(d.tokens, d.plan.tokens_per_expert);
///   auto out = moe::all_to_all_combine(y, r.probs, d.plan, ep_group);
Dispatched all_to_all_dispatch(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& keep,
                               int64_t num_experts, const Group& group);

/// Returns [T, h]: for each token, the sum over its kept pairs of the
/// expert's output times the pair's probability (probs [T, k]); tokens with
/// no kept pair get zeros. Collective over `group`.
at::Tensor all_to_all_combine(const at::Tensor& expert_output, const at::Tensor& probs, const DispatchPlan& plan,
                              const Group& group);

/// The all-gather form (see the file comment); same contract as
/// all_to_all_dispatch. Every rank must have the same number of tokens.
///
/// Example:
///   auto d = moe::all_gather_dispatch(x, r.experts, {}, 8, ep_group);
///   auto out = moe::all_gather_combine(experts(d.tokens, d.plan.tokens_per_expert), r.probs, d.plan, ep_group);
Dispatched all_gather_dispatch(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& keep,
                               int64_t num_experts, const Group& group);

/// The combine of all_gather_dispatch.
at::Tensor all_gather_combine(const at::Tensor& expert_output, const at::Tensor& probs, const DispatchPlan& plan,
                              const Group& group);

}  // namespace commgrad::moe
