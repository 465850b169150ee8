#include "model.h"

#include <stdexcept>

namespace gpt {

namespace tp = commgrad::tp;

namespace {

// The MoE feed-forward block of a layer (seeded as the layer's MLP would be).
// Under sequence parallelism each TP rank routes its own part of the
// sequences (the experts replicated over TP, their gradients summed there).
// Under context parallelism the per-sequence balancing loss counts the
// sequence's other parts (on the ranks of `cp`) too.
std::function<torch::nn::AnyModule(const tp::ParallelTransformerLayerOptions&)> moe_block(const GptConfig& config,
                                                                                          const commgrad::Group& cp) {
  return [config, cp](const tp::ParallelTransformerLayerOptions& o) {
    namespace moe = commgrad::moe;
    const commgrad::Group ep = config.ep_group.defined() ? config.ep_group : commgrad::self_group();
    return torch::nn::AnyModule(moe::MoELayer(
        moe::MoELayerOptions(o.hidden_size(), o.ffn_hidden_size(), config.experts, config.topk, ep)
            .routing(moe::RoutingOptions(config.routing).aux_loss_per_sequence(true).context_parallel_group(cp))
            .capacity_factor(config.capacity_factor)
            .sequence_parallel_group(o.sequence_parallel() ? o.group() : commgrad::Group())
            .seed(*o.seed() + 2)));
  };
}

// Layer `l` of a stage whose first layer is `first`: the configured
// recomputation for the first recompute_layers layers of the stage (all
// when 0), none for the rest.
tp::RecomputeGranularity layer_recompute(const GptConfig& config, int64_t first, int64_t l) {
  const bool recomputed = config.recompute_layers == 0 || l - first < config.recompute_layers;
  return recomputed ? config.recompute : tp::RecomputeGranularity::kNone;
}

}  // namespace

GptRankImpl::GptRankImpl(const GptConfig& config, int pp_rank, int pp_size, int stages_per_rank,
                         const commgrad::Group& tp_group, const commgrad::cp::ContextParallelOptions& context_parallel)
    : config_(config), tp_group_(tp_group), pp_size_(pp_size), stage_count_(pp_size * stages_per_rank) {
  const int tp = tp_group.size();
  const bool cp = context_parallel.group().defined() && context_parallel.group().size() > 1;
  const int64_t local_sequence = cp ? config.sequence / context_parallel.group().size() : config.sequence;
  if (config.layers % stage_count_ != 0) {
    throw std::invalid_argument(std::to_string(config.layers) + " layers do not split into " +
                                std::to_string(stage_count_) + " stages");
  }
  if (config.vocab % tp != 0 || (config.sequence_parallel && local_sequence % tp != 0)) {
    throw std::invalid_argument("the vocabulary (" + std::to_string(config.vocab) +
                                ") or, with sequence parallelism, "
                                "the sequence (" +
                                std::to_string(local_sequence) +
                                " on a rank) does not split over TP=" + std::to_string(tp));
  }
  const int64_t per_stage = config.layers / stage_count_;
  for (int v = 0; v < stages_per_rank; ++v) {
    const int global = v * pp_size + pp_rank;
    stages_.push_back({global, global * per_stage, (global + 1) * per_stage});
  }
  const bool first = stages_.front().global == 0;
  const bool last = stages_.back().global == stage_count_ - 1;
  // N(0, 1) rows scaled by 1/sqrt(h), so the (tied) output starts near uniform.
  auto vocab_weight = [&](const char* name, uint64_t seed) {
    auto module =
        register_module(name, tp::VocabParallelEmbedding(
                                  tp::VocabParallelEmbeddingOptions(config.vocab, config.hidden, tp_group).seed(seed)));
    torch::NoGradGuard no_grad;
    module->weight.mul_(1.0 / std::sqrt(static_cast<double>(config.hidden)));
    return module;
  };
  if (first || (last && config.tie)) embedding_ = vocab_weight("embedding", 1);
  if (last && !config.tie) output_ = vocab_weight("output", 3);
  if (first) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
    positions_ = register_parameter("positions", at::randn({config.sequence, 1, config.hidden}, gen) * 0.02);
    if (cp) {
      local_positions_ =
          commgrad::cp::local_positions(config.sequence, context_parallel.layout(), context_parallel.group());
    }
  }
  layers_.resize(config.layers, tp::ParallelTransformerLayer{nullptr});
  for (const auto& s : stages_) {
    for (int64_t l = s.first_layer; l < s.end_layer; ++l) {
      auto options = tp::ParallelTransformerLayerOptions(config.hidden, config.heads, config.ffn, tp_group)
                         .sequence_parallel(config.sequence_parallel)
                         .recompute(layer_recompute(config, s.first_layer, l))
                         .hidden_dropout(config.dropout)
                         .attention_dropout(config.dropout)
                         .seed(100 + l)
                         .context_parallel(cp ? std::make_optional(context_parallel) : std::nullopt);
      if (config.experts > 0 && l % config.moe_every == config.moe_every - 1)
        options.feed_forward(moe_block(config, cp ? context_parallel.group() : commgrad::Group()));
      layers_[l] = register_module("layer" + std::to_string(l), tp::ParallelTransformerLayer(options));
    }
  }
  if (last) {
    final_norm_ = register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.hidden})));
    if (config.sequence_parallel) {
      // Inside the sequence-parallel region: each TP rank sees its chunk.
      set_shard_spec("final_norm.weight", tp::ShardSpec::sequence_parallel(), tp_group);
      set_shard_spec("final_norm.bias", tp::ShardSpec::sequence_parallel(), tp_group);
    }
  }
}

commgrad::fsdp::FullyShardedModule GptRankImpl::fully_shard(const commgrad::fsdp::FullyShardOptions& options,
                                                            const commgrad::Group& embedding_group,
                                                            const commgrad::Group& expert_data_group) {
  namespace fsdp = commgrad::fsdp;
  // Experts first: summed over the expert-data group, divided by the data size.
  if (config_.experts > 0) {
    commgrad::moe::fully_shard_experts(*this, options,
                                       expert_data_group.defined() ? expert_data_group : options.group());
  }
  for (auto& layer : layers_) {
    if (layer) fsdp::fully_shard(layer, options);
  }
  // A tied copy on another stage is a unit of its own, so that both copies
  // split into the same ranges and their gradients can be summed.
  if (!tied_parameters().empty())
    fsdp::fully_shard(embedding_, fsdp::FullyShardOptions(options).tied_group(embedding_group));
  return fsdp::fully_shard(shared_from_this(), options);
}

// Every module runs through fsdp::call (a plain forward when the model is not sharded).
torch::Tensor GptRankImpl::forward_stage(int local, const torch::Tensor& input) {
  namespace fsdp = commgrad::fsdp;
  return fsdp::call_function(*this, [&] {
    const auto& s = stages_.at(local);
    torch::Tensor x = input;
    if (s.global == 0) {
      // [s, b, h]; with context parallelism this rank's tokens and their positions.
      x = fsdp::call(embedding_, input.t()) +
          (local_positions_.defined() ? positions_.index_select(0, local_positions_) : positions_);
      if (config_.sequence_parallel) x = tp::scatter_to_sequence_parallel_region(x, tp_group_);
    }
    for (int64_t l = s.first_layer; l < s.end_layer; ++l) x = fsdp::call(layers_[l], x);
    if (s.global == stage_count_ - 1) {
      x = final_norm_(x);
      // The output layer: column-parallel over the vocabulary, with the
      // embedding's weight or, untied, its own (Family 1: identity forward,
      // gradient all-reduced).
      x = config_.sequence_parallel ? tp::gather_from_sequence_parallel_region(x, tp_group_)
                                    : tp::copy_to_tp_region(x, tp_group_);
      const auto& vocab = config_.tie ? embedding_ : output_;
      x = fsdp::call_function(*vocab, [&] { return torch::matmul(x, vocab->weight.t()); });
    }
    return x;
  });
}

torch::Tensor GptRankImpl::forward(const torch::Tensor& ids) {
  if (pp_size_ != 1) throw std::logic_error("GptRank::forward: the rank holds part of a pipeline; use pp::Pipeline");
  torch::Tensor x = ids;
  for (size_t v = 0; v < stages_.size(); ++v) x = forward_stage(static_cast<int>(v), x);
  return x;
}

torch::Tensor GptRankImpl::loss(const torch::Tensor& logits, const torch::Tensor& targets) const {
  // In float32 whatever the compute dtype (bfloat16 or float16 logits).
  return tp::vocab_parallel_cross_entropy(logits.to(at::kFloat), targets.t(),
                                          tp::CrossEntropyOptions().group(tp_group_));
}

std::vector<std::string> GptRankImpl::tied_parameters() const {
  const bool first = stages_.front().global == 0;
  const bool last = stages_.back().global == stage_count_ - 1;
  if (config_.tie && first != last) return {"embedding.weight"};
  return {};
}

std::vector<int> GptRankImpl::stages() const {
  std::vector<int> out;
  for (const auto& s : stages_) out.push_back(s.global);
  return out;
}

}  // namespace gpt
