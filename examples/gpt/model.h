#pragma once
// The small GPT of examples/gpt_train and bench/gpt_bench, as one rank of a
// tensor x pipeline layout holds it.
//
// The model: a vocabulary-parallel embedding plus learned positions, N
// ParallelTransformerLayers (pre-LayerNorm, causal attention, Megatron's
// column/row-parallel split), a final LayerNorm and the output layer, whose
// weight is the embedding's (tied, vocabulary-parallel), with
// vocabulary-parallel cross entropy. With sequence parallelism the
// activations between the embedding and the output layer are split along
// the sequence over the TP group (Megatron's SP).
//
// A pipeline of p ranks with v stages per rank cuts the layers into p v
// stages of equal size; stage s lives on pipeline rank s % p. The rank of
// the first stage holds the embedding and the positions, the rank of the
// last stage the final norm and a copy of the embedding for the output
// layer (Megatron's shared embedding: the two copies' gradients are summed
// over commgrad::ParallelState::embedding_group()). With `tie` off the output
// layer has a weight of its own ("output.weight", vocabulary-parallel,
// initialised as the embedding is but from another seed): the form that
// frameworks which cannot share a weight between stages can express
// (bench/gpt_bench.py, torch.distributed.pipelining). Parameters are named as the
// whole model names them ("layer3.attention.qkv.weight", "embedding.weight")
// and every layer is initialised from its own seed, so the model is the same
// at every layout and checkpoints move between layouts.
//
// With context parallelism (a context-parallel group of W > 1) every rank
// holds its part of each sequence in the head-tail layout (cp/sequence.h):
// token ids [b, s/W], the learned positions of those tokens, activations
// [s/W, b, h], and attention across the group (cp::attention).

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace gpt {

/// The model's sizes and how it is split.
struct GptConfig {
  int64_t vocab = 64;
  int64_t sequence = 16;
  int64_t hidden = 32;
  int64_t heads = 4;
  int64_t ffn = 64;
  int64_t layers = 4;
  bool sequence_parallel = false;
  /// Activation recomputation of every layer (tp::ParallelTransformerLayerOptions::recompute).
  commgrad::tp::RecomputeGranularity recompute = commgrad::tp::RecomputeGranularity::kNone;
  /// With recompute: only the first `recompute_layers` layers of each stage
  /// recompute, the others keep their activations (Megatron's
  /// recompute_method=block with recompute_num_layers); 0: every layer.
  int64_t recompute_layers = 0;
  /// Attention and hidden dropout of every layer (training only; the masks
  /// come from tp::rng_tracker(), which the Trainer seeds).
  double dropout = 0.0;
  /// The output layer's weight is the embedding's (false: a weight of its own).
  bool tie = true;
  /// Mixture of experts (commgrad::moe): 0, a dense FFN in every layer; E,
  /// every `moe_every`-th layer's FFN is a MoELayer of E experts of width ffn
  /// (top-k routing, per-sequence load-balancing loss), split over `ep_group`.
  int64_t experts = 0;
  int64_t topk = 2;
  int moe_every = 1;
  /// The routers' scores and losses (per-sequence balancing loss always; its
  /// batch_group, the data x context group, counts the expert bias's loads).
  commgrad::moe::RoutingOptions routing = commgrad::moe::RoutingOptions().aux_loss_coeff(1e-2);
  double capacity_factor = 0.0;  // 0: dropless
  commgrad::Group ep_group;      // undefined: this rank holds every expert
};

/// The layers of the stages one rank holds (see the file comment).
class GptRankImpl : public torch::nn::Module, public commgrad::tp::ShardedModule {
 public:
  /// Pipeline rank `pp_rank` of `pp_size`, `stages_per_rank` stages on each,
  /// split over `tp_group`. Errors when the layers do not split into the
  /// stages or the vocabulary or sequence not over the TP group.
  /// `context_parallel`: the attention's context parallelism (none when
  /// its group is undefined or of one rank).
  GptRankImpl(const GptConfig& config, int pp_rank, int pp_size, int stages_per_rank, const commgrad::Group& tp_group,
              const commgrad::cp::ContextParallelOptions& context_parallel = {});

  /// This rank's `local`-th stage (global stage local * pp_size + pp_rank):
  /// token ids [b, s] in on the first stage, activations [s, b, h] (or
  /// [s/tp, b, h] with SP) between stages, logits [s, b, V/tp] out of the last.
  torch::Tensor forward_stage(int local, const torch::Tensor& input);
  /// Shards the parameters over options.group() (commgrad::fsdp): one unit
  /// per layer, the embedding one of its own when a copy of it lives on
  /// another stage (its gradient summed over `embedding_group`), the rest
  /// (positions, final norm, untied output) the root; with experts, the
  /// experts of each MoE layer a unit over `expert_data_group` first
  /// (commgrad::moe::fully_shard_experts). Returns the root.
  commgrad::fsdp::FullyShardedModule fully_shard(const commgrad::fsdp::FullyShardOptions& options,
                                                 const commgrad::Group& embedding_group,
                                                 const commgrad::Group& expert_data_group = {});
  /// The whole model on one rank of a pipeline of one: ids -> logits.
  torch::Tensor forward(const torch::Tensor& ids);
  /// Cross entropy of one microbatch: logits [s, b, V/tp], targets [b, s].
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const;

  /// The names of the parameters tied to another rank's copy
  /// ({"embedding.weight"} on the ranks of the first and the last stage when
  /// they differ and the model is tied, else none).
  std::vector<std::string> tied_parameters() const;
  /// The global stages this rank holds.
  std::vector<int> stages() const;
  const GptConfig& config() const { return config_; }

 private:
  struct Stage {
    int global = 0;
    int64_t first_layer = 0, end_layer = 0;
  };
  GptConfig config_;
  commgrad::Group tp_group_;
  int pp_size_ = 1;
  int stage_count_ = 1;
  std::vector<Stage> stages_;
  commgrad::tp::VocabParallelEmbedding embedding_{nullptr};
  commgrad::tp::VocabParallelEmbedding output_{nullptr};  // untied only: the output layer's weight
  torch::Tensor positions_;
  torch::Tensor local_positions_;  // with context parallelism: the positions of this rank's tokens
  std::vector<commgrad::tp::ParallelTransformerLayer> layers_;  // by global index; null where another rank has it
  torch::nn::LayerNorm final_norm_{nullptr};
};
TORCH_MODULE(GptRank);

}  // namespace gpt
