// TopKRouter: gating linear, softmax, top-k, and the balancing losses
// injected into backward (router.h states the normalisation).
//
// The only communication is the load-balancing loss's count of assignments
// per expert over the batch group: one raw all_reduce of E + 1 int64 (the
// counts and the batch's token count), not differentiable (f carries no
// gradient in Switch). Everything else is local to the rank's tokens, so the
// router computes, per token, exactly what the one-rank layer computes.
//
// Under sequence parallelism (a sequence-parallel group of n > 1) the rank
// holds 1/n of every sequence and the n ranks hold one replicated loss: the
// counts are also summed over that group (per sequence, or with the batch
// group's), P and the z-loss's mean are divided by n (the mean over the
// rank's tokens is n times its share of the mean over the group's), and the
// gating weight enters through tp::copy_to_tp_region, whose backward sums
// its gradient over the group. Each rank's losses are then its part, and
// their sum over the group is the unsplit router's.

#include "commgrad/moe/router.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/linear.h"
#include "commgrad/tp/mappings.h"
#include "commgrad/tp/random.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace commgrad::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Megatron's MoEAuxLossAutoScaler: identity on x, `scale` into the loss.
class AttachLoss : public torch::autograd::Function<AttachLoss> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& loss, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["loss_dtype"] = static_cast<int64_t>(loss.scalar_type());
    return x.clone();  // [T, k] combine weights: a copy is cheaper than a view's bookkeeping
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["loss_dtype"].toInt());
    return {grads[0], at::full({}, scale, at::TensorOptions().dtype(dtype)), at::Tensor()};
  }
};

at::ScalarType score_dtype(const at::Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }

// True when `sp` splits the sequences over more than one rank.
bool is_split(const Group& sp) { return sp.defined() && sp.size() > 1; }

// The switch loss of each of b sequences (token t = i * b + j belongs to
// sequence j, as in an [s, b, h] input), averaged over the sequences. With a
// sequence-parallel group the rank holds 1/n of each sequence: the counts are
// summed over the group (before any early return: every rank takes part) and
// P is this rank's share of the mean over the whole sequence.
at::Tensor sequence_load_balancing_loss(const at::Tensor& scores, const at::Tensor& experts, int64_t sequences,
                                        int64_t num_experts, int64_t top_k, double coeff, const Group& sp,
                                        const Group& cp) {
  const int64_t tokens = scores.size(0);
  const int64_t length = tokens / sequences;  // this rank's tokens of each sequence
  const at::Tensor seq = at::arange(tokens, experts.options()).remainder(sequences).unsqueeze(1);
  at::Tensor counts = at::bincount((seq * num_experts + experts).reshape(-1), {}, sequences * num_experts)
                          .view({sequences, num_experts});
  const int64_t parts = is_split(sp) ? sp.size() : 1;
  if (parts > 1) counts = ops::raw::all_reduce(counts, {}, sp).wait();
  // Context parallelism: the other parts' counts too; P stays this rank's mean.
  const int64_t context = is_split(cp) ? cp.size() : 1;
  if (context > 1) counts = ops::raw::all_reduce(counts, {}, cp).wait();
  if (tokens == 0) return scores.sum() * 0.0;
  const at::Tensor f = counts.to(scores.scalar_type()) / static_cast<double>(length * parts * context * top_k);
  at::Tensor p = scores.view({length, sequences, num_experts}).mean(0);
  if (parts > 1) p = p / static_cast<double>(parts);
  return (f * p).sum(1).mean() * (coeff * static_cast<double>(num_experts));
}

// The switch loss with f counted over the batch group (and the sequence-
// parallel group: one all-reduce of E + 1 int64 each, no gradient) and P the
// rank's share of the mean over its group's tokens.
at::Tensor batch_load_balancing_loss(const at::Tensor& scores, const at::Tensor& experts, int64_t num_experts,
                                     int64_t top_k, double coeff, const Group& batch, const Group& sp) {
  at::Tensor counts =
      at::cat({at::bincount(experts.reshape(-1), {}, num_experts), at::full({1}, scores.size(0), at::kLong)});
  if (batch.size() > 1) counts = ops::raw::all_reduce(counts, {}, batch).wait();
  if (is_split(sp)) counts = ops::raw::all_reduce(counts, {}, sp).wait();
  const int64_t batch_tokens = counts[-1].item<int64_t>();
  const at::Tensor aux = switch_load_balancing_loss(scores, counts.slice(0, 0, -1), batch_tokens, top_k, coeff);
  return is_split(sp) ? aux / static_cast<double>(sp.size()) : aux;
}

}  // namespace

const char* score_function_name(ScoreFunction f) { return f == ScoreFunction::kSigmoid ? "sigmoid" : "softmax"; }

void set_aux_loss_scale(torch::nn::Module& module, double scale) {
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* router = dynamic_cast<TopKRouterImpl*>(m.get())) router->loss_scale = scale;
  }
}

at::Tensor attach_loss(const at::Tensor& x, const at::Tensor& loss, double scale) {
  TORCH_CHECK(loss.dim() == 0, "[commgrad] moe::attach_loss: expected a scalar loss, got ", tensor_name(loss));
  return AttachLoss::apply(x, loss, scale);
}

at::Tensor switch_load_balancing_loss(const at::Tensor& scores, const at::Tensor& counts, int64_t batch_tokens,
                                      int64_t top_k, double coeff) {
  const int64_t experts = scores.size(1);
  if (batch_tokens == 0) return scores.sum() * 0.0;
  const at::Tensor f = counts.to(scores.scalar_type()) / static_cast<double>(batch_tokens * top_k);
  // P_i: the mean over this rank's tokens (none: no contribution).
  const at::Tensor p = scores.size(0) == 0 ? scores.sum(0) : scores.mean(0);
  return (f * p).sum() * (coeff * static_cast<double>(experts));
}

TopKRouterImpl::TopKRouterImpl(TopKRouterOptions options_) : options(std::move(options_)) { reset(); }

void TopKRouterImpl::reset() {
  const char* op = "moe::TopKRouter";
  if (!options.routing().batch_group().defined()) options.routing().batch_group(self_group());
  // Under an installed layout with context parallelism each rank holds part
  // of every sequence: the per-sequence loss counts the other parts too.
  if (options.routing().aux_loss_per_sequence() && !options.routing().context_parallel_group().defined() &&
      model_parallel_is_initialized() && parallel_state().context_parallel_size() > 1) {
    options.routing().context_parallel_group(parallel_state().context_parallel_group());
  }
  const Group& g = options.routing().batch_group();
  const int64_t e = options.num_experts();
  COMMGRAD_CHECK(options.hidden_size() > 0 && e > 0, op, g, "hidden size and experts must be positive, got hidden ",
                 options.hidden_size(), " and ", e, " experts");
  COMMGRAD_CHECK(options.top_k() >= 1 && options.top_k() <= e, op, g, "top_k must be in [1, experts = ", e, "], got ",
                 options.top_k());
  COMMGRAD_CHECK(options.routing().aux_loss_coeff() >= 0 && options.routing().z_loss_coeff() >= 0, op, g,
                 "loss coefficients must be >= 0, got aux ", options.routing().aux_loss_coeff(), " and z ",
                 options.routing().z_loss_coeff());
  if (options.sequence_parallel_group().defined()) check_member(op, options.sequence_parallel_group());
  if (options.routing().context_parallel_group().defined())
    check_member(op, options.routing().context_parallel_group());
  options.seed(tp::resolve_seed(options.seed(), g));
  weight = register_parameter("weight", tp::init_linear(options.hidden_size(), e, false, *options.seed()).weight);
  COMMGRAD_CHECK(options.routing().expert_bias_rate() >= 0, op, g, "expert_bias_rate must be >= 0, got ",
                 options.routing().expert_bias_rate());
  if (options.routing().expert_bias_rate() > 0) expert_bias = register_buffer("expert_bias", at::zeros({e}));
  load_ = at::zeros({e}, at::kLong);
}

void TopKRouterImpl::update_expert_bias() {
  const double rate = options.routing().expert_bias_rate();
  if (rate <= 0) return;
  const Group& g = options.routing().batch_group();
  at::Tensor load = g.size() > 1 ? ops::raw::all_reduce(load_, {}, g).wait() : load_.clone();
  const Group& sp = options.sequence_parallel_group();
  if (is_split(sp)) load = ops::raw::all_reduce(load, {}, sp).wait();
  const at::Tensor f = load.to(at::kDouble);
  at::NoGradGuard no_grad;
  expert_bias.add_((f.mean() - f).sign().to(expert_bias.scalar_type()) * rate);
  load_.zero_();
}

void update_expert_bias(torch::nn::Module& module) {
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* router = dynamic_cast<TopKRouterImpl*>(m.get())) router->update_expert_bias();
  }
}

void TopKRouterImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::moe::TopKRouter(hidden=" << options.hidden_size() << ", experts=" << options.num_experts()
         << ", top_k=" << options.top_k();
  if (options.routing().score_function() != ScoreFunction::kSoftmax) {
    stream << ", score_function=" << score_function_name(options.routing().score_function());
  }
  if (options.routing().normalize_top_k()) stream << ", normalize_top_k=true";
  if (options.routing().aux_loss_coeff() > 0) stream << ", aux_loss_coeff=" << options.routing().aux_loss_coeff();
  if (options.routing().z_loss_coeff() > 0) stream << ", z_loss_coeff=" << options.routing().z_loss_coeff();
  if (options.routing().expert_bias_rate() > 0) stream << ", expert_bias_rate=" << options.routing().expert_bias_rate();
  if (is_split(options.sequence_parallel_group())) stream << ", sp=" << options.sequence_parallel_group().size();
  stream << ")";
}

// The k best experts of each token by score (+ bias) and their scores.
std::tuple<at::Tensor, at::Tensor> TopKRouterImpl::choose(const at::Tensor& scores, int64_t k) {
  if (!expert_bias.defined()) return at::topk(scores, k, -1, /*largest=*/true, /*sorted=*/true);
  const at::Tensor experts = std::get<1>(at::topk(scores.detach() + expert_bias.to(scores.scalar_type()), k, -1));
  {
    at::NoGradGuard no_grad;
    load_.add_(at::bincount(experts.reshape(-1), {}, options.num_experts()));
  }
  return {scores.gather(1, experts), experts};
}

RouterOutput TopKRouterImpl::forward(const at::Tensor& x, int64_t sequences) {
  const Group& g = options.routing().batch_group();
  COMMGRAD_CHECK(x.defined() && x.dim() == 2 && x.size(1) == options.hidden_size(), "moe::TopKRouter", g,
                 "expected input [tokens, hidden=", options.hidden_size(), "], got ",
                 x.defined() ? tensor_name(x) : std::string("an undefined tensor"));
  const int64_t k = options.top_k();
  const RoutingOptions& routing = options.routing();
  COMMGRAD_CHECK(sequences >= 1 && x.size(0) % sequences == 0, "moe::TopKRouter", g, "the ", x.size(0),
                 " tokens do not split into ", sequences, " sequences");
  const Group& sp = options.sequence_parallel_group();
  const double parts = is_split(sp) ? sp.size() : 1;
  RouterOutput out;
  // The gating linear in at least float32 (Megatron's moe_router_dtype): with
  // 16-bit activations, logits rounded to 16 bits tie and flip top-k choices.
  const at::ScalarType dtype = score_dtype(x);
  const at::Tensor w = is_split(sp) ? tp::copy_to_tp_region(weight, sp) : weight;
  const at::Tensor logits = at::linear(x.to(dtype), w.to(dtype));
  out.logits = logits;
  const bool sigmoid = routing.score_function() == ScoreFunction::kSigmoid;
  const at::Tensor scores = sigmoid ? at::sigmoid(logits) : at::softmax(logits, -1);
  // What the balancing loss's P averages: a distribution over the experts per token.
  const at::Tensor shares = sigmoid ? scores / scores.sum(-1, /*keepdim=*/true) : scores;
  auto [top, experts] = choose(scores, k);
  if (routing.normalize_top_k()) top = top / top.sum(-1, /*keepdim=*/true);
  out.experts = experts;
  at::Tensor probs = top;
  const auto zero = at::zeros({}, logits.options());
  out.aux_loss = zero;
  out.z_loss = zero;
  at::Tensor injected;
  if (routing.aux_loss_coeff() > 0) {
    const at::Tensor aux =
        routing.aux_loss_per_sequence()
            ? sequence_load_balancing_loss(shares, experts, sequences, options.num_experts(), k,
                                           routing.aux_loss_coeff(), sp, routing.context_parallel_group())
            : batch_load_balancing_loss(shares, experts, options.num_experts(), k, routing.aux_loss_coeff(), g, sp);
    out.aux_loss = aux.detach();
    injected = aux;
  }
  if (routing.z_loss_coeff() > 0) {
    const at::Tensor lse = at::logsumexp(logits, -1);
    at::Tensor z = x.size(0) == 0 ? lse.sum() : lse.pow(2).mean() * routing.z_loss_coeff();
    if (parts > 1) z = z / parts;
    out.z_loss = z.detach();
    injected = injected.defined() ? injected + z : z;
  }
  if (injected.defined()) probs = attach_loss(probs, injected, loss_scale);
  out.probs = probs.to(x.scalar_type());
  return out;
}

}  // namespace commgrad::moe
