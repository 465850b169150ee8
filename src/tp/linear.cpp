// ColumnParallelLinear and RowParallelLinear.
//
// Column-parallel (weight rows split): forward is a local matmul on a
// replicated input, so the only communication is in backward, where the
// input gradient dL/dX = sum_r dY_r A_r must be summed over the ranks (the
// backward of Megatron's "f", copy_to_tp_region). Instead of composing "f"
// with a matmul, the layer uses one autograd Function (Megatron's
// LinearWithGradAccumulationAndAsyncCommunication) whose backward
//   1. computes dX = dY A_r and STARTS its all-reduce (ops::raw, async),
//   2. computes dA_r = dY^T X while the all-reduce runs on the transport's
//      threads,
//   3. waits for the all-reduce.
// Under sequence parallelism the input is a sequence chunk: forward
// all-gathers it along dim 0; backward re-gathers it (only the chunk is saved,
// as in Megatron) while dX is computed, then reduce-scatters dX along the
// sequence while dA_r is computed.
//
// Zero-bubble schedules (weight_gradients.h): a forward run under
// DeferWeightGradients saves the queue; its backward computes the input
// gradient as above and, instead of dA_r, queues what dA_r needs (dY and
// the layer's full input). The queued matmul is the one backward would
// have run, and the one at::matmul's backward runs for the row layer, so
// the gradient is the same bit for bit.
//
// Row-parallel (weight columns split): the local matmul of the input's
// feature slice gives partial sums, reduced with "g" (reduce_from_tp_region)
// or, under sequence parallelism, reduce-scattered along the sequence. The
// replicated bias is added once, after the reduction; under sequence
// parallelism its gradient is partial per rank and marked so
// (ShardSpec::sequence_parallel()).

#include "commgrad/tp/linear.h"

#include "detail/common.h"

#include "commgrad/ops/raw.h"
#include "commgrad/tp/mappings.h"
#include "commgrad/tp/parallel_state.h"
#include "commgrad/tp/random.h"
#include "commgrad/tp/weight_gradients.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <string>

namespace commgrad::tp {

LinearWeights init_linear(int64_t in_features, int64_t out_features, bool bias, uint64_t seed) {
  TORCH_CHECK(in_features >= 1 && out_features >= 1, "[commgrad] init_linear: in_features (", in_features,
              ") and out_features (", out_features, ") must be positive");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  LinearWeights w;
  w.weight = at::empty({out_features, in_features}, at::kFloat).uniform_(-bound, bound, gen);
  if (bias) w.bias = at::empty({out_features}, at::kFloat).uniform_(-bound, bound, gen);
  return w;
}

namespace detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// dA = dY^T X over all leading dims: [out, in].
at::Tensor weight_gradient(const at::Tensor& grad_out, const at::Tensor& input) {
  return at::matmul(grad_out.reshape({-1, grad_out.size(-1)}).t(), input.reshape({-1, input.size(-1)}));
}

// The deferral queue and the weight (the parameter itself, whose gradient
// accumulator compute() feeds), when the forward runs under
// DeferWeightGradients.
struct DeferralCapsule : torch::CustomClassHolder {
  std::shared_ptr<WeightGradients::Queue> queue;
  at::Tensor weight;
};

void save_deferral(AutogradContext* ctx, const at::Tensor& weight) {
  auto queue = deferring_weight_gradients();
  if (!queue || !weight.requires_grad()) return;
  note_deferring_layer(*queue);
  auto capsule = c10::make_intrusive<DeferralCapsule>();
  capsule->queue = std::move(queue);
  capsule->weight = weight;
  ctx->saved_data["defer"] = at::IValue::make_capsule(std::move(capsule));
}

// Queues dA = dY^T X when the forward deferred; false when it did not.
bool defer(AutogradContext* ctx, const at::Tensor& grad_out, const at::Tensor& input) {
  const auto it = ctx->saved_data.find("defer");
  if (it == ctx->saved_data.end()) return false;
  auto capsule = it->second.toCapsule();
  auto* d = static_cast<DeferralCapsule*>(capsule.get());
  defer_weight_gradient(*d->queue, d->weight, [grad_out, input] { return weight_gradient(grad_out, input); });
  return true;
}

struct ColumnParallelMatmul : torch::autograd::Function<ColumnParallelMatmul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            bool sequence_parallel, const Group& group) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["sp"] = sequence_parallel;
    save_group(ctx, group);
    save_deferral(ctx, weight);
    const at::Tensor total =
        sequence_parallel ? ops::raw::all_gather(input, ops::AllGatherOptions().dim(0), group).wait() : input;
    return at::matmul(total, weight.t());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const bool sp = ctx->saved_data["sp"].toBool();
    const Group group = saved_group(ctx);
    const at::Tensor& grad_out = grads[0];
    const bool need_input = ctx->needs_input_grad(0);
    const bool need_weight = ctx->needs_input_grad(1);

    // Under SP the weight gradient needs the full sequence: re-gather it
    // while the input gradient is computed.
    ops::raw::Pending gathering;
    if (sp && need_weight) gathering = ops::raw::all_gather(input, ops::AllGatherOptions().dim(0), group);

    at::Tensor grad_input;
    ops::raw::Pending reducing;
    if (need_input) {
      grad_input = at::matmul(grad_out, weight);
      reducing = sp ? ops::raw::reduce_scatter(grad_input, ops::ReduceScatterOptions().dim(0), group)
                    : ops::raw::all_reduce(grad_input, {}, group);
    }

    at::Tensor grad_weight;
    if (need_weight) {
      const at::Tensor total = sp ? gathering.wait() : input;
      // Overlapped with the input-gradient reduction started above.
      if (!defer(ctx, grad_out, total)) grad_weight = weight_gradient(grad_out, total);
    }
    if (reducing.defined()) grad_input = reducing.wait();
    return {grad_input, grad_weight, {}, {}};
  }
};

// X A^T of the row-parallel layer when its weight gradient is deferred
// (otherwise the layer calls at::matmul, whose backward this repeats).
struct DeferredMatmul : torch::autograd::Function<DeferredMatmul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight) {
    ctx->save_for_backward({input, weight});
    save_deferral(ctx, weight);
    return at::matmul(input, weight.t());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& grad_out = grads[0];
    at::Tensor grad_input, grad_weight;
    if (ctx->needs_input_grad(0)) grad_input = at::matmul(grad_out, saved[1]);
    if (ctx->needs_input_grad(1) && !defer(ctx, grad_out, saved[0])) grad_weight = weight_gradient(grad_out, saved[0]);
    return {grad_input, grad_weight};
  }
};

void check_input(const char* op, const Group& g, const at::Tensor& input, int64_t features, const at::Tensor& weight,
                 const char* what, const std::string& hint = "") {
  COMMGRAD_CHECK(input.defined(), op, g, "got an undefined input");
  COMMGRAD_CHECK(input.dim() >= 1 && input.size(-1) == features, op, g, "expected an input of shape [..., ", features,
                 "] (", what, "), got ", describe(input), hint);
  COMMGRAD_CHECK(input.scalar_type() == weight.scalar_type(), op, g, "input ", describe(input),
                 " does not have the dtype of the weight ", describe(weight));
}

// What to change when a row layer's input has the other layout's width:
// the whole in_features while input_is_parallel, or this rank's part without it.
std::string row_input_hint(const at::Tensor& input, const RowParallelLinearOptions& options, int64_t n) {
  if (!input.defined() || input.dim() < 1 || n == 1) return "";
  const int64_t last = input.size(-1);
  if (options.input_is_parallel() && last == options.in_features()) {
    return "; the input holds all in_features: pass input_is_parallel(false) to have the layer split it, or feed it "
           "this rank's part (a ColumnParallelLinear's output with gather_output(false))";
  }
  if (!options.input_is_parallel() && last == options.in_features() / n) {
    return "; the input holds this rank's part of in_features (a ColumnParallelLinear's output with "
           "gather_output(false)?): pass input_is_parallel(true)";
  }
  return "";
}

void check_sequence(const char* op, const Group& g, const at::Tensor& x, const char* what) {
  COMMGRAD_CHECK(x.dim() >= 2, op, g, "with sequence_parallel the ", what, " must be [sequence, ..., features], got ",
                 describe(x));
}

// Both linears start alike: the group from the layout unless given, and
// positive feature counts.
template <typename Options>
void resolve_group_and_check_features(Options& options, const char* op) {
  options.group(resolve_tp_group(options.group(), op));
  COMMGRAD_CHECK(options.in_features() >= 1 && options.out_features() >= 1, op, options.group(), "in_features (",
                 options.in_features(), ") and out_features (", options.out_features(), ") must be positive");
}

}  // namespace

at::Tensor column_parallel_matmul(const at::Tensor& input, const at::Tensor& weight, bool sequence_parallel,
                                  const Group& group) {
  return ColumnParallelMatmul::apply(input, weight, sequence_parallel, group);
}
}  // namespace detail

at::Tensor deferrable_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  if (!detail::deferring_weight_gradients() || !weight.requires_grad() || !at::GradMode::is_enabled()) {
    return at::linear(input, weight, bias);
  }
  const at::Tensor y = detail::DeferredMatmul::apply(input, weight);
  return bias.defined() ? y + bias : y;
}

// ~~~ ColumnParallelLinear ~~~

ColumnParallelLinearOptions::ColumnParallelLinearOptions(int64_t in_features, int64_t out_features, Group group)
    : in_features_(in_features), out_features_(out_features), group_(std::move(group)) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions options_)
    : options(std::move(options_)) {
  reset();
}

void ColumnParallelLinearImpl::reset() {
  const char* op = "ColumnParallelLinear";
  detail::resolve_group_and_check_features(options, op);
  const Group& g = options.group();
  const int64_t n = g.size();
  COMMGRAD_CHECK(options.stride() >= 1, op, g, "stride must be at least 1, got ", options.stride());
  COMMGRAD_CHECK(options.out_features() % (n * options.stride()) == 0, op, g, "out_features (", options.out_features(),
                 ") is not divisible by the tensor-parallel size (", n, ")",
                 options.stride() > 1 ? c10::str(" x stride (", options.stride(), ")") : std::string());
  COMMGRAD_CHECK(!(options.sequence_parallel() && options.gather_output()), op, g,
                 "sequence_parallel and gather_output cannot both be set (the output of a sequence-parallel "
                 "column layer stays split; gather it after the following row-parallel layer)");
  COMMGRAD_CHECK(!(options.gather_output() && options.stride() > 1), op, g, "gather_output with stride ",
                 options.stride(), " would interleave the output blocks");
  const int64_t local_out = options.out_features() / n;
  weight = register_parameter("weight", at::empty({local_out, options.in_features()}));
  const auto spec = ShardSpec::partitioned(0, options.stride());
  set_shard_spec("weight", spec, g);
  if (options.bias()) {
    bias = register_parameter("bias", at::empty({local_out}));
    set_shard_spec("bias", spec, g);
  }
  options.seed(resolve_seed(options.seed(), g));
  reset_parameters();
}

void ColumnParallelLinearImpl::reset_parameters() {
  const Group& g = options.group();
  auto full = init_linear(options.in_features(), options.out_features(), options.bias(), options.seed().value());
  const auto spec = ShardSpec::partitioned(0, options.stride());
  at::NoGradGuard no_grad;
  weight.copy_(shard_tensor(full.weight, spec, g.rank(), g.size()));
  if (bias.defined()) bias.copy_(shard_tensor(full.bias, spec, g.rank(), g.size()));
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "commgrad::tp::ColumnParallelLinear(in=" << options.in_features()
         << ", out=" << options.out_features() << ", tp=" << options.group().size()
         << ", gather_output=" << options.gather_output();
  if (!options.bias()) stream << ", bias=false";
  if (options.skip_bias_add()) stream << ", skip_bias_add=true";
  if (options.sequence_parallel()) stream << ", sequence_parallel=true";
  if (options.stride() > 1) stream << ", stride=" << options.stride();
  stream << ")";
}

LinearOutput ColumnParallelLinearImpl::forward_with_bias(const at::Tensor& input) {
  const char* op = "ColumnParallelLinear";
  const Group& g = options.group();
  detail::check_input(op, g, input, options.in_features(), weight, "in_features");
  if (options.sequence_parallel()) detail::check_sequence(op, g, input, "input");
  at::Tensor out = detail::column_parallel_matmul(input, weight, options.sequence_parallel(), g);
  LinearOutput result;
  if (bias.defined()) {
    if (options.skip_bias_add()) {
      result.bias = bias;
    } else {
      out = out + bias;
    }
  }
  result.output = options.gather_output() ? gather_from_tp_region(out, g) : out;
  return result;
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) { return forward_with_bias(input).output; }

// ~~~ RowParallelLinear ~~~

RowParallelLinearOptions::RowParallelLinearOptions(int64_t in_features, int64_t out_features, Group group)
    : in_features_(in_features), out_features_(out_features), group_(std::move(group)) {}

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions options_) : options(std::move(options_)) {
  reset();
}

void RowParallelLinearImpl::reset() {
  const char* op = "RowParallelLinear";
  detail::resolve_group_and_check_features(options, op);
  const Group& g = options.group();
  const int64_t n = g.size();
  COMMGRAD_CHECK(options.in_features() % n == 0, op, g, "in_features (", options.in_features(),
                 ") is not divisible by the tensor-parallel size (", n, ")");
  COMMGRAD_CHECK(!options.sequence_parallel() || options.input_is_parallel(), op, g,
                 "sequence_parallel needs input_is_parallel (the input of a sequence-parallel row layer is the "
                 "split output of a column layer)");
  weight = register_parameter("weight", at::empty({options.out_features(), options.in_features() / n}));
  set_shard_spec("weight", ShardSpec::partitioned(1), g);
  if (options.bias()) {
    bias = register_parameter("bias", at::empty({options.out_features()}));
    set_shard_spec("bias", options.sequence_parallel() ? ShardSpec::sequence_parallel() : ShardSpec::replicated(), g);
  }
  options.seed(resolve_seed(options.seed(), g));
  reset_parameters();
}

void RowParallelLinearImpl::reset_parameters() {
  const Group& g = options.group();
  auto full = init_linear(options.in_features(), options.out_features(), options.bias(), options.seed().value());
  at::NoGradGuard no_grad;
  weight.copy_(shard_tensor(full.weight, ShardSpec::partitioned(1), g.rank(), g.size()));
  if (bias.defined()) bias.copy_(full.bias);
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "commgrad::tp::RowParallelLinear(in=" << options.in_features()
         << ", out=" << options.out_features() << ", tp=" << options.group().size()
         << ", input_is_parallel=" << options.input_is_parallel();
  if (!options.bias()) stream << ", bias=false";
  if (options.skip_bias_add()) stream << ", skip_bias_add=true";
  if (options.sequence_parallel()) stream << ", sequence_parallel=true";
  stream << ")";
}

LinearOutput RowParallelLinearImpl::forward_with_bias(const at::Tensor& input) {
  const char* op = "RowParallelLinear";
  const Group& g = options.group();
  const int64_t n = g.size();
  detail::check_input(op, g, input, options.input_is_parallel() ? options.in_features() / n : options.in_features(),
                      weight, options.input_is_parallel() ? "in_features / tp: input_is_parallel" : "in_features",
                      detail::row_input_hint(input, options, n));
  if (options.sequence_parallel()) {
    detail::check_sequence(op, g, input, "input");
    COMMGRAD_CHECK(input.size(0) % n == 0, op, g, "with sequence_parallel the sequence length (dim 0 of ",
                   detail::describe(input), ") must be divisible by the tensor-parallel size ", n);
  }
  const at::Tensor x = options.input_is_parallel() ? input : scatter_to_tp_region(input, g);
  const at::Tensor partial =
      detail::deferring_weight_gradients() ? detail::DeferredMatmul::apply(x, weight) : at::matmul(x, weight.t());
  at::Tensor out = options.sequence_parallel() ? reduce_scatter_to_sequence_parallel_region(partial, g)
                                               : reduce_from_tp_region(partial, g);
  LinearOutput result;
  if (bias.defined()) {
    if (options.skip_bias_add()) {
      result.bias = bias;
    } else {
      out = out + bias;
    }
  }
  result.output = out;
  return result;
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) { return forward_with_bias(input).output; }

}  // namespace commgrad::tp
