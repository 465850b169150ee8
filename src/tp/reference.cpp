// The unsplit references of the tensor-parallel layers (reference.h).
//
// Each is written independently of its parallel layer, from torch::nn
// modules and the textbook math, so that a layout mistake in the parallel
// path cannot be copied into it: SelfAttentionReference uses einsum over
// [s, b, heads, d] views and an additive causal mask, where
// ParallelSelfAttention reshapes its local heads and masks with masked_fill.
// The parameters come from the same seeds through init_linear(), so a
// parallel layer's shards are slices of its reference's parameters.

#include "commgrad/tp/reference.h"

#include "detail/layer_norm.h"

#include "commgrad/tp/random.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>

namespace commgrad::tp {

namespace {

// The seed given, else one draw_seed(), kept in the options (so reset() from
// clone() draws nothing). Called before any torch::nn::Linear is built: those
// draw their own (overwritten) initialisation from the same generator, and a
// reference built after torch::manual_seed(k) must draw what its parallel
// layer at TP = 1 draws.
uint64_t own_seed(std::optional<uint64_t>& seed) {
  if (!seed) seed = draw_seed();
  return *seed;
}

}  // namespace

// ~~~ init_reference_linear ~~~

void init_reference_linear(torch::nn::Linear& linear, uint64_t seed) {
  const auto& o = linear->options;
  const LinearWeights full = init_linear(o.in_features(), o.out_features(), o.bias(), seed);
  at::NoGradGuard no_grad;
  linear->weight.copy_(full.weight);
  if (o.bias()) linear->bias.copy_(full.bias);
}

// ~~~ MLPReference ~~~

MLPReferenceImpl::MLPReferenceImpl(ParallelMLPOptions options_) : options(std::move(options_)) { reset(); }

void MLPReferenceImpl::reset() {
  const int64_t h = options.hidden_size(), ffn = options.ffn_hidden_size();
  const uint64_t seed = own_seed(options.seed());
  fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(h, ffn).bias(options.bias())));
  fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(ffn, h).bias(options.bias())));
  init_reference_linear(fc1, seed);
  init_reference_linear(fc2, seed + 1);
}

void MLPReferenceImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::tp::MLPReference(hidden=" << options.hidden_size() << ", ffn=" << options.ffn_hidden_size()
         << ")";
}

at::Tensor MLPReferenceImpl::forward(const at::Tensor& input) { return fc2->forward(at::gelu(fc1->forward(input))); }

// ~~~ TransformerLayerReference ~~~

TransformerLayerReferenceImpl::TransformerLayerReferenceImpl(ParallelTransformerLayerOptions options_)
    : options(std::move(options_)) {
  reset();
}

void TransformerLayerReferenceImpl::reset() {
  const int64_t h = options.hidden_size();
  const uint64_t seed = own_seed(options.seed());
  ln1 = register_module("ln1", detail::make_layernorm(h, options.layernorm_eps()));
  attention = register_module("attention", SelfAttentionReference(ParallelSelfAttentionOptions(h, options.num_heads())
                                                                      .attention_dropout(options.attention_dropout())
                                                                      .seed(seed)));
  ln2 = register_module("ln2", detail::make_layernorm(h, options.layernorm_eps()));
  mlp = register_module("mlp", MLPReference(ParallelMLPOptions(h, options.ffn_hidden_size()).seed(seed + 2)));
}

void TransformerLayerReferenceImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::tp::TransformerLayerReference(hidden=" << options.hidden_size()
         << ", heads=" << options.num_heads() << ", ffn=" << options.ffn_hidden_size() << ")";
}

at::Tensor TransformerLayerReferenceImpl::forward(const at::Tensor& input) {
  const RngTracker tracker = rng_tracker();
  auto drop = [&](const at::Tensor& x) { return tp::dropout(x, options.hidden_dropout(), is_training(), tracker); };
  const at::Tensor residual = input + drop(attention->forward(ln1->forward(input)));
  return residual + drop(mlp->forward(ln2->forward(residual)));
}

// ~~~ SelfAttentionReference ~~~

SelfAttentionReferenceImpl::SelfAttentionReferenceImpl(ParallelSelfAttentionOptions options_)
    : options(std::move(options_)) {
  reset();
}

void SelfAttentionReferenceImpl::reset() {
  const int64_t h = options.hidden_size(), heads = options.num_heads();
  TORCH_CHECK(h >= 1 && heads >= 1 && h % heads == 0, "[commgrad] SelfAttentionReference: hidden_size (", h,
              ") must be a positive multiple of num_heads (", heads, ")");
  const uint64_t seed = own_seed(options.seed());
  qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(h, 3 * h).bias(options.bias())));
  dense = register_module("dense", torch::nn::Linear(torch::nn::LinearOptions(h, h).bias(options.bias())));
  init_reference_linear(qkv, seed);
  init_reference_linear(dense, seed + 1);
}

void SelfAttentionReferenceImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "commgrad::tp::SelfAttentionReference(hidden=" << options.hidden_size()
         << ", heads=" << options.num_heads() << ", causal=" << options.causal() << ")";
}

at::Tensor SelfAttentionReferenceImpl::forward(const at::Tensor& input) {
  TORCH_CHECK(input.dim() == 3 && input.size(2) == options.hidden_size(),
              "[commgrad] SelfAttentionReference: expected input [seq, batch, hidden=", options.hidden_size(),
              "], got ", input.sizes());
  const int64_t s = input.size(0), b = input.size(1), h = options.hidden_size(), heads = options.num_heads();
  const int64_t d = h / heads;
  const at::Tensor mixed = qkv->forward(input);  // [s, b, 3h] = [Q | K | V]
  const at::Tensor q = mixed.narrow(-1, 0, h).reshape({s, b, heads, d});
  const at::Tensor k = mixed.narrow(-1, h, h).reshape({s, b, heads, d});
  const at::Tensor v = mixed.narrow(-1, 2 * h, h).reshape({s, b, heads, d});
  at::Tensor scores = at::einsum("ibhd,jbhd->bhij", {q, k}) / std::sqrt(static_cast<double>(d));
  if (options.causal()) {
    scores = scores + at::full({s, s}, -std::numeric_limits<double>::infinity(), scores.options()).triu(1);
  }
  at::Tensor probs = at::softmax(scores, -1);
  if (is_training() && options.attention_dropout() > 0) {
    probs = tp::dropout(probs, options.attention_dropout(), true, rng_tracker());
  }
  const at::Tensor context = at::einsum("bhij,jbhd->ibhd", {probs, v}).reshape({s, b, h});
  return dense->forward(context);
}

}  // namespace commgrad::tp
