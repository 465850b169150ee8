// MoELayer: router -> (capacity) -> dispatch -> experts -> combine.
//
// The layer adds no collective of its own: the router counts assignments
// over the batch group (only with an aux loss), the dispatcher exchanges the
// counts and the rows, the combine sends the rows back. Every check of the
// configuration (experts divisible by ep, 1 <= k <= E, positive sizes) runs
// at construction, before any collective, and names the layer and group.

#include "commgrad/moe/moe_layer.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/fsdp/fully_shard.h"
#include "commgrad/tp/random.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>

namespace commgrad::moe {

MoELayerImpl::MoELayerImpl(MoELayerOptions options_) : options(std::move(options_)) { reset(); }

void MoELayerImpl::reset() {
  const char* op = "moe::MoELayer";
  if (!options.group().defined()) {
    options.group(model_parallel_is_initialized() ? parallel_state().expert_parallel_group() : self_group());
  }
  const Group& g = options.group();
  const int64_t e = options.num_experts();
  detail::check_expert_sizes(op, g, options.hidden_size(), options.ffn_hidden_size(), e);
  COMMGRAD_CHECK(options.top_k() >= 1 && options.top_k() <= e, op, g, "top_k must be in [1, experts = ", e, "], got ",
                 options.top_k());
  COMMGRAD_CHECK(options.capacity_factor() >= 0, op, g, "capacity_factor must be >= 0 (0: dropless), got ",
                 options.capacity_factor());
  if (!options.routing().batch_group().defined()) options.routing().batch_group(g);
  const Group& sp = options.sequence_parallel_group();
  if (sp.defined()) check_member(op, sp);
  options.seed(tp::resolve_seed(options.seed(), g));
  const uint64_t seed = *options.seed();
  router = register_module("router", TopKRouter(TopKRouterOptions(options.hidden_size(), e, options.top_k())
                                                    .routing(options.routing())
                                                    .sequence_parallel_group(sp)
                                                    .seed(seed)));
  experts = register_module("experts", Experts(ExpertsOptions(options.hidden_size(), options.ffn_hidden_size(), e, g)
                                                   .sequence_parallel_group(sp)
                                                   .seed(seed + 1)));
}

void MoELayerImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::moe::MoELayer(hidden=" << options.hidden_size() << ", ffn=" << options.ffn_hidden_size()
         << ", experts=" << options.num_experts() << ", top_k=" << options.top_k() << ", ep=" << options.group().size();
  if (options.capacity_factor() > 0) {
    stream << ", capacity_factor=" << options.capacity_factor()
           << ", drop_policy=" << drop_policy_name(options.drop_policy());
  }
  if (options.dispatcher() == DispatcherType::kAllGather) stream << ", dispatcher=all_gather";
  const Group& sp = options.sequence_parallel_group();
  if (sp.defined() && sp.size() > 1) stream << ", sp=" << sp.size();
  stream << ")";
}

at::Tensor MoELayerImpl::forward(const at::Tensor& x) {
  const Group& g = options.group();
  const int64_t h = options.hidden_size();
  COMMGRAD_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == h, "moe::MoELayer", g, "expected input [..., hidden=", h,
                 "], got ", x.defined() ? tensor_name(x) : std::string("an undefined tensor"));
  const bool per_sequence = options.routing().aux_loss_per_sequence();
  COMMGRAD_CHECK(!per_sequence || x.dim() == 3, "moe::MoELayer", g,
                 "aux_loss_per_sequence needs an input [seq, batch, hidden], got ", tensor_name(x));
  const at::Tensor tokens = x.reshape({-1, h});
  RouterOutput r = router(tokens, per_sequence ? x.size(1) : 1);
  at::Tensor keep;
  if (options.capacity_factor() > 0) {
    const int64_t capacity =
        expert_capacity(options.capacity_factor(), tokens.size(0), options.top_k(), options.num_experts());
    keep = capacity_mask(r.experts, r.probs, options.num_experts(), capacity, options.drop_policy());
  }
  const bool gather = options.dispatcher() == DispatcherType::kAllGather;
  const Dispatched d = gather ? all_gather_dispatch(tokens, r.experts, keep, options.num_experts(), g)
                              : all_to_all_dispatch(tokens, r.experts, keep, options.num_experts(), g);
  // Through fsdp::call: the experts may be a unit of their own (fully_shard_experts).
  const at::Tensor y =
      fsdp::call(experts, d.tokens.to(experts->local(0)->fc1->weight.scalar_type()), d.plan.tokens_per_expert)
          .to(x.scalar_type());
  const at::Tensor out = gather ? all_gather_combine(y, r.probs, d.plan, g) : all_to_all_combine(y, r.probs, d.plan, g);
  last_ = {r.logits.detach(), r.probs.detach(), r.experts, r.aux_loss, r.z_loss};
  last_tokens_per_expert_ = d.plan.tokens_per_expert;
  return out.view(x.sizes());
}

}  // namespace commgrad::moe
