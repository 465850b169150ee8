// Token dispatch (token_dispatcher.h has the steps and the bytes moved).
//
// Names: a "pair" is one (token, choice) of the router's [T, k] output,
// flat index t * k + j; "order" lists the kept pairs sorted by expert; rows
// are sent in that order, so the rows for rank r are one contiguous block
// (its experts are consecutive). The receiving rank gets, from each source
// s, a block sorted by its local experts; "regroup" reorders those blocks
// by local expert first, source second, which is the order the one-rank
// layer sees each expert's tokens in (source ranks hold consecutive parts
// of the batch).
//
// Every index is built from int64 tensors that carry no gradient; the
// gradient flows through index_select (backward: index_add), ops::all_to_all
// (backward: all_to_all with the splits swapped) and index_add (backward:
// index_select), so the expert weights see exactly the tokens' gradients, not
// scaled by any group size.

#include "commgrad/moe/token_dispatcher.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/collectives.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>

#include <cmath>

namespace commgrad::moe {
namespace {

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

void check_routing(const char* op, const Group& g, const at::Tensor& x, const at::Tensor& experts,
                   const at::Tensor& keep, int64_t num_experts) {
  check_member(op, g);
  COMMGRAD_CHECK(num_experts > 0 && num_experts % g.size() == 0, op, g, "the number of experts (", num_experts,
                 ") must be positive and divisible by the expert-parallel size ", g.size());
  COMMGRAD_CHECK(x.dim() == 2, op, g, "expected tokens [T, hidden], got ", tensor_name(x));
  COMMGRAD_CHECK(experts.dim() == 2 && experts.size(0) == x.size(0) && experts.scalar_type() == at::kLong, op, g,
                 "expected experts int64[", x.size(0), ", k], got ", tensor_name(experts));
  COMMGRAD_CHECK(!keep.defined() || keep.sizes() == experts.sizes(), op, g, "expected keep of ", tensor_name(experts),
                 "'s shape, got ", tensor_name(keep));
  if (experts.numel() > 0) {
    const int64_t lo = experts.min().item<int64_t>(), hi = experts.max().item<int64_t>();
    COMMGRAD_CHECK(lo >= 0 && hi < num_experts, op, g, "expert indices must be in [0, ", num_experts, "), got [", lo,
                   ", ", hi, "]");
  }
}

// The kept pairs, sorted by expert (stable), and their experts.
std::pair<at::Tensor, at::Tensor> sorted_pairs(const at::Tensor& experts, const at::Tensor& keep) {
  const at::Tensor flat = experts.reshape(-1);
  const at::Tensor candidates =
      keep.defined() ? at::nonzero(keep.reshape(-1)).reshape(-1) : at::arange(flat.numel(), flat.options());
  auto [sorted, idx] = at::sort(flat.index_select(0, candidates), /*stable=*/true, 0, /*descending=*/false);
  return {candidates.index_select(0, idx), sorted};
}

// Rows received from source s for local expert l start at offset(s, l);
// the regrouped order takes expert 0's blocks from every source, then 1's.
std::pair<at::Tensor, std::vector<int64_t>> regroup_by_expert(const at::Tensor& received_counts, int64_t sources,
                                                              int64_t local) {
  const std::vector<int64_t> c = to_vector(received_counts);  // [sources * local]
  std::vector<int64_t> start(c.size());
  int64_t offset = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    start[i] = offset;
    offset += c[i];
  }
  std::vector<int64_t> regroup;
  regroup.reserve(offset);
  std::vector<int64_t> per_expert(local, 0);
  for (int64_t l = 0; l < local; ++l) {
    for (int64_t s = 0; s < sources; ++s) {
      const int64_t i = s * local + l;
      for (int64_t r = 0; r < c[i]; ++r) regroup.push_back(start[i] + r);
      per_expert[l] += c[i];
    }
  }
  return {at::tensor(regroup, at::kLong), per_expert};
}

at::Tensor inverse_permutation(const at::Tensor& p) {
  return at::empty_like(p).scatter_(0, p, at::arange(p.numel(), p.options()));
}

}  // namespace

const char* drop_policy_name(DropPolicy policy) {
  return policy == DropPolicy::kProbability ? "probability" : "position";
}

int64_t expert_capacity(double capacity_factor, int64_t tokens, int64_t top_k, int64_t num_experts) {
  return static_cast<int64_t>(
      std::ceil(capacity_factor * static_cast<double>(tokens * top_k) / static_cast<double>(num_experts)));
}

at::Tensor capacity_mask(const at::Tensor& experts, const at::Tensor& probs, int64_t num_experts, int64_t capacity,
                         DropPolicy policy) {
  const at::Tensor flat = experts.reshape(-1);
  const int64_t pairs = flat.numel();
  // Pairs in the order the policy prefers them, then grouped by expert (stable).
  at::Tensor preferred = at::arange(pairs, flat.options());
  if (policy == DropPolicy::kProbability) {
    preferred = std::get<1>(at::sort(probs.detach().reshape(-1), /*stable=*/true, 0, /*descending=*/true));
  }
  auto [sorted, idx] = at::sort(flat.index_select(0, preferred), /*stable=*/true, 0, false);
  const at::Tensor pair = preferred.index_select(0, idx);
  const at::Tensor counts = at::bincount(flat, {}, num_experts);
  const at::Tensor starts = counts.cumsum(0) - counts;
  const at::Tensor rank_in_expert = at::arange(pairs, flat.options()) - starts.index_select(0, sorted);
  at::Tensor keep = at::zeros({pairs}, flat.options().dtype(at::kBool));
  keep.scatter_(0, pair, rank_in_expert < capacity);
  return keep.view(experts.sizes());
}

// ~~~ all-to-all ~~~

Dispatched all_to_all_dispatch(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& keep,
                               int64_t num_experts, const Group& group) {
  const char* op = "moe::all_to_all_dispatch";
  check_routing(op, group, x, experts, keep, num_experts);
  const int64_t ep = group.size(), local = num_experts / ep;
  Dispatched d;
  DispatchPlan& plan = d.plan;
  plan.tokens = x.size(0);
  plan.top_k = experts.size(1);
  at::Tensor sorted;
  std::tie(plan.order, sorted) = sorted_pairs(experts, keep);
  plan.token_of = at::div(plan.order, plan.top_k, "trunc");
  const at::Tensor counts = at::bincount(sorted, {}, num_experts);  // [E]: this rank's pairs per expert
  plan.input_splits = to_vector(counts.view({ep, local}).sum(1));
  const at::Tensor send = x.index_select(0, plan.token_of);
  at::Tensor received_counts = counts;
  at::Tensor received = send;
  if (ep > 1) {
    received_counts = ops::raw::all_to_all(counts, {}, group).wait();  // [ep * local]: from s, for my l
    plan.output_splits = to_vector(received_counts.view({ep, local}).sum(1));
    received = ops::all_to_all(
        send, ops::AllToAllOptions().input_splits(plan.input_splits).output_splits(plan.output_splits), group);
  } else {
    plan.output_splits = plan.input_splits;
  }
  std::tie(plan.regroup, plan.tokens_per_expert) = regroup_by_expert(received_counts, ep, local);
  d.tokens = received.index_select(0, plan.regroup);
  return d;
}

at::Tensor all_to_all_combine(const at::Tensor& expert_output, const at::Tensor& probs, const DispatchPlan& plan,
                              const Group& group) {
  const char* op = "moe::all_to_all_combine";
  COMMGRAD_CHECK(!plan.all_gather && expert_output.dim() == 2 && expert_output.size(0) == plan.regroup.numel(), op,
                 group, "expected the experts' outputs [", plan.regroup.numel(),
                 ", hidden] of an all-to-all dispatch, got ", tensor_name(expert_output));
  COMMGRAD_CHECK(probs.dim() == 2 && probs.size(0) == plan.tokens && probs.size(1) == plan.top_k, op, group,
                 "expected probs [", plan.tokens, ", ", plan.top_k, "], got ", tensor_name(probs));
  at::Tensor back = expert_output.index_select(0, inverse_permutation(plan.regroup));
  if (group.size() > 1) {
    back = ops::all_to_all(
        back, ops::AllToAllOptions().input_splits(plan.output_splits).output_splits(plan.input_splits), group);
  }
  const at::Tensor weights = probs.reshape(-1).index_select(0, plan.order).to(back.scalar_type());
  const at::Tensor zeros = at::zeros({plan.tokens, expert_output.size(1)}, back.options());
  return zeros.index_add(0, plan.token_of, back * weights.unsqueeze(1));
}

// ~~~ all-gather ~~~

Dispatched all_gather_dispatch(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& keep,
                               int64_t num_experts, const Group& group) {
  const char* op = "moe::all_gather_dispatch";
  check_routing(op, group, x, experts, keep, num_experts);
  const int64_t ep = group.size(), local = num_experts / ep, first = group.rank() * local;
  const at::Tensor chosen = keep.defined() ? at::where(keep, experts, at::full({}, -1, experts.options())) : experts;
  const at::Tensor all_x = ep > 1 ? ops::all_gather(x, {}, group) : x;
  const at::Tensor all_e = ep > 1 ? ops::raw::all_gather(chosen.contiguous(), {}, group).wait() : chosen;
  Dispatched d;
  DispatchPlan& plan = d.plan;
  plan.all_gather = true;
  plan.tokens = x.size(0);
  plan.top_k = experts.size(1);
  const at::Tensor flat = all_e.reshape(-1);
  const at::Tensor mine = at::nonzero((flat >= first) & (flat < first + local)).reshape(-1);
  auto [sorted, idx] = at::sort(flat.index_select(0, mine), /*stable=*/true, 0, false);
  plan.gathered_pair_of = mine.index_select(0, idx);
  plan.gathered_token_of = at::div(plan.gathered_pair_of, plan.top_k, "trunc");
  plan.tokens_per_expert = to_vector(at::bincount(sorted - first, {}, local));
  d.tokens = all_x.index_select(0, plan.gathered_token_of);
  return d;
}

at::Tensor all_gather_combine(const at::Tensor& expert_output, const at::Tensor& probs, const DispatchPlan& plan,
                              const Group& group) {
  const char* op = "moe::all_gather_combine";
  COMMGRAD_CHECK(plan.all_gather && expert_output.dim() == 2 && expert_output.size(0) == plan.gathered_pair_of.numel(),
                 op, group, "expected the experts' outputs [", plan.gathered_pair_of.numel(),
                 ", hidden] of an all-gather dispatch, got ", tensor_name(expert_output));
  const int64_t ep = group.size();
  const at::Tensor all_p = ep > 1 ? ops::all_gather(probs, {}, group) : probs;
  const at::Tensor weights = all_p.reshape(-1).index_select(0, plan.gathered_pair_of).to(expert_output.scalar_type());
  const at::Tensor zeros = at::zeros({plan.tokens * ep, expert_output.size(1)}, expert_output.options());
  const at::Tensor partial = zeros.index_add(0, plan.gathered_token_of, expert_output * weights.unsqueeze(1));
  return ep > 1 ? ops::reduce_scatter(partial, {}, group) : partial;
}

}  // namespace commgrad::moe
