#pragma once
// One rank's part of the GPT (examples/gpt/model.h), its sharded optimizer
// and its pipeline: what examples/gpt_train and bench/gpt_bench both train.
//
// The rank holds the stages pp::Pipeline gives it, split over the TP group;
// one ZeroOptimizer (ZeRO-2, AdamW at 3e-3 with weight decay 0.01, global
// gradient-norm clipping at 1.0 over every stage and TP rank, the tied
// embedding summed over the embedding group) over the DP group, or, with
// `fsdp`, the model sharded by commgrad::fsdp (one unit per layer) and the
// same AdamW over this rank's pieces, clipped the same way. With experts
// (GptConfig::experts) a second ZeroOptimizer over the expert-data group
// steps the experts (commgrad::moe::expert_ddp_options: summed, divided by
// the DP size), clipped with the dense parameters by one global norm that
// counts every expert once (ZeroOptimizerOptions::clip_partner); with `fsdp`
// the experts of each layer are a unit over the expert-data group
// (commgrad::moe::fully_shard_experts) and the one clip_grad_norm_ counts
// each once. Precision bf16
// computes in bfloat16 (FSDP: float32 shards, float32 gradient reductions;
// ZeRO-2: bfloat16 parameters with float32 masters and float32 reductions,
// one dp::MixedPrecisionPolicy for both); fp16 computes in float16 under
// either with optim::DynamicLossScaler (initial scale 2^16 by default; the inf/NaN
// check agreed over DP, TP and PP; a skipped step leaves every rank as it
// was; with experts under fsdp only). A step takes
// batch k of a corpus: every replica its batch/dp rows, split into the
// microbatches; under context parallelism each rank of a CP group its
// head-tail part of every sequence (the loss is the mean over its tokens,
// averaged over data x context: the mean over every token).

#include "model.h"
#include "corpus.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gpt {

/// The groups of a layout (commgrad::ParallelState's, or one rank's own group for all).
/// With context parallelism, `cp` splits each sequence (head-tail) and
/// `dp_cp` (data x context) is the group gradients and the logged loss are
/// averaged over; undefined: none, and dp.
struct Layout {
  commgrad::Group tp, pp, dp, embedding;
  commgrad::Group cp = {}, dp_cp = {};
  /// The group gradients and the logged loss are averaged over.
  const commgrad::Group& replicas() const { return dp_cp.defined() ? dp_cp : dp; }
  /// With experts: the expert-data-parallel group (undefined: dp).
  commgrad::Group expert_dp = {};
};

/// The optimizer every layout steps with (and the reference of --check).
inline torch::optim::AdamWOptions adamw_options() { return torch::optim::AdamWOptions(3e-3).weight_decay(0.01); }
/// The compute dtype of a precision: none ("fp32"), bfloat16 ("bf16") or
/// float16 ("fp16"); errors on another name.
c10::optional<at::ScalarType> compute_dtype(const std::string& precision);
/// Gradients are clipped to this global L2 norm.
constexpr double kMaxGradNorm = 1.0;

/// Called once or more per step with this rank's pieces of the gradients the
/// optimizer is about to use (views: changing them changes the step), in the
/// coordinates of the whole model and named by parameter, after every
/// reduction and before clipping; `step` is 1-based.
using GradientInspector =
    std::function<void(int step, const std::vector<commgrad::checkpoint::TensorPiece>& gradients)>;

/// How the rank trains: the global batch and the pipeline's schedule.
struct TrainerOptions {
  int64_t batch = 8;  // global, divisible by dp * microbatches
  int microbatches = 4;
  std::string schedule = "1f1b";  // "interleaved" on a pipeline of one rank runs as 1f1b
  int stages_per_rank = 1;
  /// Parameters, gradients and optimizer state sharded over DP
  /// (commgrad::fsdp, one unit per layer) instead of ZeRO-2.
  bool fsdp = false;
  /// "fp32", "bf16" (bfloat16 compute, float32 masters and reductions) or
  /// "fp16" (float16 compute with dynamic loss scaling).
  std::string precision = "fp32";
  /// fp16: the loss scaler's first scale (a power of two; one so large that
  /// the first steps overflow shows the scaler skipping them).
  double loss_scale_init = 65536.0;
  /// With a context-parallel group: allgather, ring or ulysses (cp::AttentionMode).
  std::string cp_mode = "ring";
  /// save() copies the state to host memory and writes it in the background
  /// (checkpoint::AsyncSaver) while training goes on.
  bool async_save = false;
};

class Trainer {
 public:
  Trainer(const TrainerOptions& options, const GptConfig& model_config, const Layout& layout);

  /// Step k (0-based) of the corpus; returns the loss (the mean over the
  /// replicas), the same on every rank.
  double step(const Corpus& corpus, int k);
  /// The global gradient norm of the last step, before clipping (NaN when
  /// the loss scaler skipped it).
  double last_grad_norm() const { return grad_norm_; }
  /// The global gradient norm (before clipping) of every step this Trainer
  /// trained, by step (1-based; NaN for a step the loss scaler skipped).
  const std::map<int, double>& grad_norms() const { return grad_norms_; }
  /// Every step from now on calls `inspect` (see GradientInspector).
  void inspect_gradients(GradientInspector inspect);
  /// This rank's pieces of the parameters (views), in the coordinates of the
  /// whole model and named by parameter (no prefix), buffers left out.
  std::vector<commgrad::checkpoint::TensorPiece> parameter_pieces() const;

  /// The pipeline's report of the last step (this rank's compute and step time).
  const commgrad::pp::PipelineStepResult& last_step() const { return last_; }

  /// This rank's part of the model.
  const GptRank& model() const { return model_; }

  /// The loss scaler (precision fp16), else null.
  const commgrad::optim::DynamicLossScaler* loss_scaler() const { return scaler_.get(); }
  /// The steps (k + 1 of step(corpus, k)) whose update the loss scaler
  /// skipped (inf/NaN gradients on some rank), in this Trainer's life.
  const std::vector<int>& skipped_steps() const { return skipped_; }

  /// Writes a sharded checkpoint (model and optimizer) of step `step` under `root`.
  void save(const std::string& root, int step, const std::string& layout);
  /// Waits until every checkpoint save() started is on disk (async_save).
  void finish_saves();
  /// Loads step `step` (default: the latest) under `root`; returns it and the layout it was saved at.
  std::pair<int, std::string> load(const std::string& root, std::optional<int64_t> step = std::nullopt);

 private:
  TrainerOptions options_;
  Layout layout_;
  GptRank model_;
  void make_optimizer();
  std::unique_ptr<commgrad::optim::ZeroOptimizer> zero_;
  std::unique_ptr<commgrad::optim::ZeroOptimizer> expert_zero_;  // with experts: their parameters
  commgrad::fsdp::FullyShardedModule sharded_;                   // with fsdp
  std::unique_ptr<torch::optim::Optimizer> optimizer_;           // with fsdp
  std::unique_ptr<commgrad::optim::DynamicLossScaler> scaler_;   // with fp16
  std::vector<int> skipped_;                                     // steps the scaler skipped
  GradientInspector inspect_;
  int step_ = 0;             // the step being trained (1-based)
  double grad_norm_ = -1.0;  // of the last step
  std::map<int, double> grad_norms_;
  void inspect(const std::vector<commgrad::checkpoint::TensorPiece>& gradients) const;
  void inspect_zero(const std::vector<commgrad::optim::ZeroOptimizer::StateShard>& gradients) const;
  void step_sharded();
  void unscale_losses(double scale);
  std::vector<commgrad::pp::NoSyncFunction> no_sync_functions();
  std::unique_ptr<commgrad::pp::Pipeline> pipe_;
  commgrad::pp::PipelineStepResult last_;
  std::unique_ptr<commgrad::checkpoint::AsyncSaver> saver_;  // with async_save, from the first save
};

}  // namespace gpt
