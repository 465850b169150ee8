// vocab_parallel_cross_entropy: cross entropy over logits split by
// vocabulary, rank r holding the logits of [r V/n, (r+1) V/n).
//
// For one token with logits x (split) and target t:
//   m    = max_j x_j                      all_reduce MAX
//   z_j  = x_j - m                        (stability; a new tensor)
//   z_t  = the target's logit (owner)     -+
//   Z    = sum_j z_j (label smoothing)     +- one all_reduce SUM of [z_t, (Z,) S]
//   S    = sum_j exp(z_j)                 -+
//   loss = (1 - eps) (log S - z_t) + eps (log S - Z / V)
// with V the GLOBAL vocabulary, as torch's cross_entropy defines label
// smoothing. The gradient, softmax_j - (1 - eps) [j == t] - eps / V, needs
// only this rank's slice of the softmax (saved in forward): backward does no
// communication. Ignored tokens (target == ignore_index) get loss 0 and no
// gradient, and the mean divides by the number of tokens not ignored.

#include "commgrad/tp/cross_entropy.h"

#include "detail/common.h"

#include "commgrad/ops/raw.h"
#include "commgrad/tp/parallel_state.h"

#include <ATen/ATen.h>

#include <vector>

namespace commgrad::tp {

namespace {

using detail::save_group;
using detail::saved_group;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            int64_t ignore_index, double eps, const Group& group) {
    const at::ScalarType compute =
        logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kHalf ? at::kFloat : logits.scalar_type();
    const at::Tensor x = logits.detach().to(compute);
    const int64_t local_v = x.size(-1);
    const int64_t V = local_v * group.size();
    const int64_t start = group.rank() * local_v;

    // Row maximum over the whole vocabulary.
    at::Tensor m = std::get<0>(x.max(-1));
    m = ops::raw::all_reduce(m, ops::AllReduceOptions().op(ReduceOp::kMax), group).wait();
    at::Tensor z = x - m.unsqueeze(-1);  // a new tensor: the caller's logits stay as they are

    const at::Tensor ignored = target.eq(ignore_index);
    const at::Tensor foreign = target.lt(start).logical_or_(target.ge(start + local_v));
    const at::Tensor local_t = (target - start).masked_fill_(foreign, 0);
    const at::Tensor z_t = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill_(foreign, 0);
    std::vector<at::Tensor> parts{z_t};
    if (eps > 0) parts.push_back(z.sum(-1));
    at::Tensor e = z.exp_();  // z is not needed any more
    parts.push_back(e.sum(-1));
    const at::Tensor stats = ops::raw::all_reduce(at::stack(parts), {}, group).wait();

    const at::Tensor sum_exp = stats[parts.size() - 1];
    const at::Tensor log_s = sum_exp.log();
    at::Tensor loss = log_s - stats[0];
    if (eps > 0) loss = (1.0 - eps) * loss + eps * (log_s - stats[1] / static_cast<double>(V));
    loss.masked_fill_(ignored, 0);

    e.div_(sum_exp.unsqueeze(-1));  // this rank's slice of the softmax
    ctx->save_for_backward({e, local_t, foreign, ignored});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["V"] = V;
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss.to(logits.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& local_t = saved[1];
    const at::Tensor& foreign = saved[2];
    const at::Tensor& ignored = saved[3];
    const double eps = ctx->saved_data["eps"].toDouble();
    const auto V = ctx->saved_data["V"].toInt();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());

    at::Tensor g = eps > 0 ? softmax - eps / static_cast<double>(V) : softmax.clone();
    const at::Tensor hit = foreign.logical_not().to(g.scalar_type()).mul_(-(1.0 - eps));
    g.scatter_add_(-1, local_t.unsqueeze(-1), hit.unsqueeze(-1));
    const at::Tensor scale = grads[0].to(g.scalar_type()).masked_fill(ignored, 0);
    g.mul_(scale.unsqueeze(-1));
    return {g.to(dtype), {}, {}, {}, {}};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const CrossEntropyOptions& options) {
  const char* op = "vocab_parallel_cross_entropy";
  const Group g = resolve_tp_group(options.group(), op);
  COMMGRAD_CHECK(logits.defined() && target.defined(), op, g, "got an undefined tensor");
  COMMGRAD_CHECK(at::isFloatingType(logits.scalar_type()), op, g, "logits must be floating point, got ",
                 detail::describe(logits));
  COMMGRAD_CHECK(logits.dim() >= 1 && logits.size(-1) >= 1, op, g,
                 "logits must be [..., vocab / tp] with a non-empty vocabulary dim, got ", detail::describe(logits));
  COMMGRAD_CHECK(target.scalar_type() == at::kLong, op, g, "target must be int64 (global token ids), got ",
                 detail::describe(target));
  COMMGRAD_CHECK(target.sizes() == logits.sizes().slice(0, logits.dim() - 1), op, g, "target ",
                 detail::describe(target), " must have the shape of logits ", detail::describe(logits),
                 " without its last (vocabulary) dim");
  COMMGRAD_CHECK(options.label_smoothing() >= 0.0 && options.label_smoothing() <= 1.0, op, g,
                 "label_smoothing must be in [0, 1], got ", options.label_smoothing());
  const int64_t V = logits.size(-1) * g.size();
  const at::Tensor valid = target.ge(0).logical_and_(target.lt(V)).logical_or_(target.eq(options.ignore_index()));
  if (!valid.all().item<bool>()) {
    const int64_t bad = target.masked_select(valid.logical_not()).view({-1})[0].item<int64_t>();
    COMMGRAD_CHECK(false, op, g, "target ", bad, " is outside the vocabulary [0, ", V, ") (", logits.size(-1),
                   " logits per rank x tp ", g.size(), ") and is not ignore_index (", options.ignore_index(), ")");
  }

  const at::Tensor loss =
      VocabParallelCrossEntropy::apply(logits, target, options.ignore_index(), options.label_smoothing(), g);
  switch (options.reduction()) {
    case Reduction::kNone:
      return loss;
    case Reduction::kSum:
      return loss.sum();
    case Reduction::kMean:
      return loss.sum() / target.ne(options.ignore_index()).sum().to(loss.scalar_type());
  }
  return loss;
}

}  // namespace commgrad::tp
