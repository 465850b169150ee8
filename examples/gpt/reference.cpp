#include "gpt/reference.h"

#include "gpt/trainer.h"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace gpt {

namespace F = torch::nn::functional;

namespace {

std::string layer_name(int64_t l) { return "layer" + std::to_string(l); }

bool is_moe(const GptConfig& config, int64_t l) {
  return config.experts > 0 && l % config.moe_every == config.moe_every - 1;
}

}  // namespace

std::string unmodelled(const GptConfig& config) {
  if (config.experts == 0) return "";
  const auto& r = config.routing;
  if (r.score_function() != commgrad::moe::ScoreFunction::kSoftmax) return "sigmoid scores";
  if (r.normalize_top_k()) return "top-k renormalisation";
  if (r.z_loss_coeff() > 0) return "the z-loss";
  if (r.expert_bias_rate() > 0) return "the expert bias";
  if (config.capacity_factor > 0) return "a capacity factor";
  return "";
}

std::map<std::string, std::vector<int64_t>> parameter_shapes(const GptConfig& c) {
  std::map<std::string, std::vector<int64_t>> shapes;
  const int64_t h = c.hidden;
  shapes["embedding.weight"] = {c.vocab, h};
  if (!c.tie) shapes["output.weight"] = {c.vocab, h};
  shapes["positions"] = {c.sequence, 1, h};
  auto linear = [&](const std::string& name, int64_t in, int64_t out) {
    shapes[name + ".weight"] = {out, in};
    shapes[name + ".bias"] = {out};
  };
  auto norm = [&](const std::string& name) {
    shapes[name + ".weight"] = {h};
    shapes[name + ".bias"] = {h};
  };
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = layer_name(l) + ".";
    norm(p + "ln1");
    norm(p + "ln2");
    linear(p + "attention.qkv", h, 3 * h);
    linear(p + "attention.dense", h, h);
    if (!is_moe(c, l)) {
      linear(p + "mlp.fc1", h, c.ffn);
      linear(p + "mlp.fc2", c.ffn, h);
      continue;
    }
    shapes[p + "mlp.router.weight"] = {c.experts, h};
    for (int64_t e = 0; e < c.experts; ++e) {
      const std::string expert = p + "mlp.experts.expert" + std::to_string(e) + ".";
      linear(expert + "fc1", h, c.ffn);
      linear(expert + "fc2", c.ffn, h);
    }
  }
  norm("final_norm");
  return shapes;
}

namespace {
// DynamicLossScalerOptions' defaults (the Trainer sets only the initial scale).
constexpr int64_t kHysteresis = 2;
constexpr int64_t kGrowthInterval = 1000;
}  // namespace

ReferenceGpt::ReferenceGpt(const GptConfig& config, const NamedTensors& initial,
                           c10::optional<at::ScalarType> compute_dtype, double loss_scale)
    : config_(config), dtype_(compute_dtype), hysteresis_left_(kHysteresis) {
  if (dtype_ == at::kHalf) scale_ = loss_scale;
  const std::string missing = unmodelled(config);
  if (!missing.empty()) throw std::invalid_argument("the reference GPT does not model " + missing + " (yet)");
  std::vector<torch::Tensor> leaves;
  for (const auto& [name, shape] : parameter_shapes(config)) {
    const auto it = initial.find(name);
    if (it == initial.end()) throw std::invalid_argument("the reference GPT has no initial weight '" + name + "'");
    if (it->second.sizes() != at::IntArrayRef(shape)) {
      throw std::invalid_argument("the reference GPT's initial '" + name + "' has shape " +
                                  c10::str(it->second.sizes()) + ", expected " + c10::str(at::IntArrayRef(shape)));
    }
    auto p = it->second.detach().to(at::kFloat).clone().set_requires_grad(true);
    params_[name] = p;
    leaves.push_back(p);
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(leaves, adamw_options());
}

// A parameter as the forward uses it: in the compute dtype (autograd carries
// the gradient back to the float32 master).
torch::Tensor ReferenceGpt::weight(const std::string& name) const {
  const auto& p = params_.at(name);
  return dtype_ ? p.to(*dtype_) : p;
}

// Causal self-attention over the whole sequence: x [s, b, h] -> [s, b, h].
torch::Tensor ReferenceGpt::attention(const std::string& prefix, const torch::Tensor& x) const {
  const int64_t s = x.size(0), b = x.size(1), h = config_.hidden, heads = config_.heads, d = h / heads;
  const auto qkv = F::linear(x, weight(prefix + "qkv.weight"), weight(prefix + "qkv.bias"));
  // [s, b, h] -> [b, heads, s, d]
  auto split_heads = [&](int64_t i) {
    return qkv.narrow(-1, i * h, h).reshape({s, b, heads, d}).permute({1, 2, 0, 3});
  };
  const auto q = split_heads(0), k = split_heads(1), v = split_heads(2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
  const auto future = torch::ones({s, s}, torch::kBool).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  const auto context = torch::matmul(torch::softmax(scores, -1), v).permute({2, 0, 1, 3}).reshape({s, b, h});
  return F::linear(context, weight(prefix + "dense.weight"), weight(prefix + "dense.bias"));
}

torch::Tensor ReferenceGpt::mlp(const std::string& prefix, const torch::Tensor& x) const {
  const auto hidden = F::linear(x, weight(prefix + "fc1.weight"), weight(prefix + "fc1.bias"));
  return F::linear(torch::gelu(hidden), weight(prefix + "fc2.weight"), weight(prefix + "fc2.bias"));
}

// The MoE block, dense: every token through each expert it chose, weighted
// by its softmax score; the per-sequence balancing loss added to aux_loss.
torch::Tensor ReferenceGpt::experts(const std::string& prefix, const torch::Tensor& x, torch::Tensor& aux_loss) const {
  const int64_t s = x.size(0), b = x.size(1), h = config_.hidden, E = config_.experts, k = config_.topk;
  const auto tokens = x.reshape({s * b, h});  // token i * b + j: position i of sequence j
  const auto logits = F::linear(tokens.to(at::kFloat), params_.at(prefix + "router.weight"));
  const auto scores = torch::softmax(logits, -1);
  const auto [top, chosen] = torch::topk(scores, k, -1);
  auto out = torch::zeros_like(tokens);
  for (int64_t e = 0; e < E; ++e) {
    const auto [rows, slots] = [&] {
      const auto hits = (chosen == e).nonzero();
      return std::make_pair(hits.select(1, 0), hits.select(1, 1));
    }();
    if (rows.numel() == 0) continue;
    const auto weights = top.index({rows, slots}).to(x.scalar_type()).unsqueeze(1);
    const auto y = mlp(prefix + "experts.expert" + std::to_string(e) + ".", tokens.index_select(0, rows));
    out = out.index_add(0, rows, weights * y);
  }
  // Switch's loss per sequence: f_i the share of the sequence's s k choices
  // that went to expert i (no gradient), P_i its mean score over the sequence.
  const auto sequence_of = torch::arange(s * b).remainder(b).unsqueeze(1).expand({s * b, k});
  const auto counts = torch::zeros({b, E}).index_put_({sequence_of.reshape(-1), chosen.reshape(-1)},
                                                      torch::ones({s * b * k}), /*accumulate=*/true);
  const auto f = counts / static_cast<double>(s * k);
  const auto P = scores.view({s, b, E}).mean(0);
  aux_loss = aux_loss + (f * P).sum(1).mean() * (config_.routing.aux_loss_coeff() * static_cast<double>(E));
  return out.view({s, b, h});
}

// ids [B, s] -> logits [s, B, V] (float32); aux_loss collects the MoE losses.
torch::Tensor ReferenceGpt::forward(const torch::Tensor& ids, torch::Tensor& aux_loss) const {
  const int64_t h = config_.hidden;
  auto x = F::embedding(ids.t(), weight("embedding.weight")) + weight("positions");  // [s, B, h]
  auto norm = [&](const std::string& name, const torch::Tensor& in) {
    return F::layer_norm(in,
                         F::LayerNormFuncOptions({h}).weight(weight(name + ".weight")).bias(weight(name + ".bias")));
  };
  for (int64_t l = 0; l < config_.layers; ++l) {
    const std::string p = layer_name(l) + ".";
    x = x + attention(p + "attention.", norm(p + "ln1", x));
    const auto normed = norm(p + "ln2", x);
    x = x + (is_moe(config_, l) ? experts(p + "mlp.", normed, aux_loss) : mlp(p + "mlp.", normed));
  }
  x = norm("final_norm", x);
  const auto& output = config_.tie ? "embedding.weight" : "output.weight";
  return torch::matmul(x, weight(output).t()).to(at::kFloat);
}

// The global L2 norm of the gradients; scales them to max_grad_norm when above.
double ReferenceGpt::clip_gradients() {
  double squares = 0;
  for (const auto& [name, p] : params_) squares += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  const double norm = std::sqrt(squares);
  const double coef = kMaxGradNorm / (norm + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : params_) p.mutable_grad().mul_(coef);
  }
  return norm;
}

// fp16: the gradients times 1/S (as float32); true when one is inf/NaN.
bool ReferenceGpt::unscale_and_check() {
  torch::NoGradGuard no_grad;
  const auto inverse = static_cast<float>(1.0 / scale_);
  bool found_inf = false;
  for (auto& [name, p] : params_) {
    p.mutable_grad().mul_(inverse);
    found_inf = found_inf || !torch::isfinite(p.grad()).all().item<bool>();
  }
  return found_inf;
}

void ReferenceGpt::update_scale(bool found_inf) {
  if (found_inf) {
    good_steps_ = 0;
    if (--hysteresis_left_ <= 0) scale_ = std::max(scale_ * 0.5, 1.0);
  } else if (++good_steps_ == kGrowthInterval) {
    good_steps_ = 0;
    hysteresis_left_ = kHysteresis;
    scale_ *= 2;
  }
}

ReferenceStep ReferenceGpt::step(const torch::Tensor& ids, const torch::Tensor& targets) {
  optimizer_->zero_grad();
  auto aux_loss = torch::zeros({});
  const auto logits = forward(ids, aux_loss);
  const auto loss = F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.t().reshape(-1));
  const bool scaled = dtype_ == at::kHalf;
  ((loss + aux_loss) * (scaled ? scale_ : 1.0)).backward();
  const bool skip = scaled && unscale_and_check();
  grads_.clear();
  for (const auto& [name, p] : params_) grads_[name] = p.grad().clone();
  if (skip) {
    update_scale(true);
    return {loss.item<double>(), std::nan(""), true};
  }
  for (const auto& [name, g] : grads_) {
    const auto a = g.abs();
    smallest_[name] = smallest_.count(name) ? torch::minimum(smallest_[name], a) : a;
  }
  ReferenceStep result{loss.item<double>(), clip_gradients(), false};
  optimizer_->step();
  if (scaled) update_scale(false);
  return result;
}

}  // namespace gpt
