// ParallelTransformerLayer (Megatron's ParallelTransformerLayer, pre-LN GPT
// block). Its unsplit reference, TransformerLayerReference, is in
// reference.cpp.
//
// The layer adds no communication of its own: attention and MLP each enter
// and leave their tensor-parallel region through their column and row
// layers, and everything between those regions (LayerNorm, dropout, the
// residual adds) is local. What changes with sequence parallelism is the
// distribution of that in-between residual stream:
//
//   off: [s, b, h] on every rank. The column layers' backward all-reduces
//        the input gradient ("f"), the row layers' forward all-reduces the
//        output ("g"). LayerNorm gradients come out complete and identical
//        on every rank. Hidden dropout must be identical on every rank (the
//        residual stream is replicated): the replicated RNG stream.
//   on:  [s/n, b, h] on rank r. "f" becomes all-gather forward /
//        reduce-scatter backward, "g" becomes reduce-scatter forward /
//        all-gather backward. Each rank's LayerNorm (and row bias) gradient
//        covers only its s/n positions: the layer marks those parameters
//        ShardSpec::sequence_parallel() and allreduce_sequence_parallel_grads()
//        sums them after backward. Hidden dropout acts on different tokens on
//        each rank: the whole forward runs under the tensor-parallel RNG
//        stream (as Megatron's ParallelTransformer does).

#include "commgrad/tp/transformer_layer.h"

#include "detail/common.h"
#include "detail/layer_norm.h"

#include "commgrad/tp/parallel_state.h"
#include "commgrad/tp/random.h"

#include <ATen/ATen.h>

#include <optional>

namespace commgrad::tp {

// ~~~ ParallelTransformerLayer ~~~

ParallelTransformerLayerOptions::ParallelTransformerLayerOptions(int64_t hidden_size, int64_t num_heads,
                                                                 int64_t ffn_hidden_size, Group group)
    : hidden_size_(hidden_size), num_heads_(num_heads), ffn_hidden_size_(ffn_hidden_size), group_(std::move(group)) {}

ParallelTransformerLayerImpl::ParallelTransformerLayerImpl(ParallelTransformerLayerOptions options_)
    : options(std::move(options_)) {
  reset();
}

void ParallelTransformerLayerImpl::reset() {
  const char* op = "ParallelTransformerLayer";
  options.group(resolve_tp_group(options.group(), op));
  const Group& g = options.group();
  COMMGRAD_CHECK(options.hidden_dropout() >= 0.0 && options.hidden_dropout() <= 1.0, op, g,
                 "hidden_dropout must be in [0, 1], got ", options.hidden_dropout());
  options.seed(resolve_seed(options.seed(), g));
  const uint64_t seed = *options.seed();
  const int64_t h = options.hidden_size();
  ln1 = register_module("ln1", detail::make_layernorm(h, options.layernorm_eps()));
  attention = register_module(
      "attention", ParallelSelfAttention(ParallelSelfAttentionOptions(h, options.num_heads(), g)
                                             .attention_dropout(options.attention_dropout())
                                             .sequence_parallel(options.sequence_parallel())
                                             .recompute_core(options.recompute() == RecomputeGranularity::kSelective)
                                             .seed(seed)
                                             .context_parallel(options.context_parallel())));
  ln2 = register_module("ln2", detail::make_layernorm(h, options.layernorm_eps()));
  if (options.feed_forward()) {
    feed_forward = options.feed_forward()(options);
    register_module("mlp", feed_forward.ptr());
  } else {
    mlp = register_module("mlp", ParallelMLP(ParallelMLPOptions(h, options.ffn_hidden_size(), g)
                                                 .sequence_parallel(options.sequence_parallel())
                                                 .seed(seed + 2)));
  }
  const ShardSpec spec = options.sequence_parallel() ? ShardSpec::sequence_parallel() : ShardSpec::replicated();
  for (const char* name : {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"}) set_shard_spec(name, spec, g);
}

void ParallelTransformerLayerImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::tp::ParallelTransformerLayer(hidden=" << options.hidden_size()
         << ", heads=" << options.num_heads() << ", ffn=" << options.ffn_hidden_size()
         << ", tp=" << options.group().size();
  if (options.sequence_parallel()) stream << ", sequence_parallel=true";
  if (options.hidden_dropout() > 0) stream << ", hidden_dropout=" << options.hidden_dropout();
  if (options.attention_dropout() > 0) stream << ", attention_dropout=" << options.attention_dropout();
  if (options.recompute() != RecomputeGranularity::kNone) {
    stream << ", recompute=" << recompute_granularity_name(options.recompute());
  }
  stream << ")";
}

at::Tensor ParallelTransformerLayerImpl::forward(const at::Tensor& input) {
  const char* op = "ParallelTransformerLayer";
  const Group& g = options.group();
  const int64_t h = options.hidden_size();
  COMMGRAD_CHECK(input.defined() && input.dim() == 3 && input.size(2) == h, op, g, "expected input [",
                 options.sequence_parallel() ? "seq/tp" : "seq", ", batch, hidden=", h, "], got ",
                 input.defined() ? detail::describe(input) : std::string("an undefined tensor"));
  if (options.recompute() != RecomputeGranularity::kFull || !is_training()) return forward_layer(input);
  auto fn = [this](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{forward_layer(in[0])}; };
  return recompute(fn, {input}, RecomputeOptions().name("ParallelTransformerLayer").parameters(parameters()))[0];
}

// The layer itself; under full recompute it runs twice (forward, backward).
at::Tensor ParallelTransformerLayerImpl::forward_layer(const at::Tensor& input) {
  const RngTracker tracker = rng_tracker();
  const bool random = is_training() && (options.hidden_dropout() > 0 || options.attention_dropout() > 0);
  std::optional<RngFork> fork;
  if (random && options.sequence_parallel()) fork.emplace(tracker.fork(kModelParallelRng));
  auto drop = [&](const at::Tensor& x) { return tp::dropout(x, options.hidden_dropout(), is_training(), tracker); };

  const at::Tensor residual = input + drop(attention(ln1(input)));
  const at::Tensor normed = ln2(residual);
  return residual + drop(mlp ? mlp(normed) : feed_forward.forward<at::Tensor>(normed));
}

}  // namespace commgrad::tp
