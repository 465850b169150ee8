#include "trainer.h"

#include <cstddef>
#include <limits>
#include <stdexcept>
#include <vector>

namespace gpt {

namespace checkpoint = commgrad::checkpoint;

namespace {

// Dropout draws from tp::rng_tracker(): seeded alike on the ranks of a
// tensor-parallel group (the replicated stream; the model-parallel one
// differs by TP rank), differently per pipeline stage (Megatron's seed +
// 100 x pipeline rank), and again for every Trainer, so that two trainings
// of one layout draw the same masks.
void seed_dropout(const GptConfig& config, const Layout& layout) {
  if (config.dropout > 0) commgrad::tp::model_parallel_manual_seed(1234 + 100 * layout.pp.rank(), layout.tp);
}

}  // namespace

constexpr const char* kExpertOptim = "expert_optim/";  // the experts' optimizer in a checkpoint

Trainer::Trainer(const TrainerOptions& options, const GptConfig& model_config, const Layout& layout)
    : options_(options),
      layout_(layout),
      model_(model_config, layout.pp.rank(), layout.pp.size(), options.stages_per_rank, layout.tp,
             commgrad::cp::ContextParallelOptions(layout.cp, commgrad::cp::parse_mode(options.cp_mode))) {
  make_optimizer();
  seed_dropout(model_config, layout);
  std::vector<commgrad::pp::StageFunction> stages;
  for (int v = 0; v < options.stages_per_rank; ++v) {
    stages.push_back([model = model_, v](const torch::Tensor& x) mutable { return model->forward_stage(v, x); });
  }
  pipe_ = std::make_unique<commgrad::pp::Pipeline>(
      std::move(stages),
      [model = model_, scaler = scaler_.get()](const torch::Tensor& logits, const torch::Tensor& y) {
        const auto loss = model->loss(logits, y);
        return scaler != nullptr ? scaler->scale(loss) : loss;
      },
      commgrad::pp::PipelineOptions(options.microbatches)
          .schedule(layout.pp.size() == 1 && options.schedule == "interleaved" ? "1f1b" : options.schedule)
          .stages_per_rank(options.stages_per_rank)
          .group(layout.pp)
          .no_sync(no_sync_functions()));
}

c10::optional<at::ScalarType> compute_dtype(const std::string& precision) {
  if (precision == "bf16") return at::kBFloat16;
  if (precision == "fp16") return at::kHalf;
  if (precision == "fp32") return c10::nullopt;
  throw std::invalid_argument("unknown precision '" + precision + "' (fp32, bf16 or fp16)");
}

void Trainer::make_optimizer() {
  const auto adamw = adamw_options();
  const auto dtype = compute_dtype(options_.precision);
  // 16-bit compute, float32 reductions and masters (both wrappers).
  const auto policy = commgrad::dp::MixedPrecisionPolicy().param_dtype(dtype).reduce_dtype(
      dtype ? c10::optional<at::ScalarType>(at::kFloat) : c10::nullopt);
  if (options_.precision == "fp16") {
    if (model_->config().experts > 0 && !options_.fsdp) {
      throw std::invalid_argument("experts with fp16 need fsdp (one loss scaler over every gradient)");
    }
    scaler_ =
        std::make_unique<commgrad::optim::DynamicLossScaler>(commgrad::optim::DynamicLossScalerOptions()
                                                                 .initial_scale(options_.loss_scale_init)
                                                                 .groups({layout_.replicas(), layout_.tp, layout_.pp}));
  }
  if (options_.fsdp) {
    sharded_ = model_->fully_shard(commgrad::fsdp::FullyShardOptions(layout_.replicas()).mixed_precision(policy),
                                   layout_.embedding, layout_.expert_dp);
    optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(), adamw);
    return;
  }
  if (dtype) model_->to(*dtype);  // ZeroOptimizer keeps float32 masters
  auto make_adamw = [adamw](std::vector<torch::Tensor> shards) {
    return std::make_unique<torch::optim::AdamW>(shards, adamw);
  };
  const bool experts = model_->config().experts > 0;
  auto ddp = commgrad::dp::DistributedDataParallelOptions(layout_.replicas());
  if (experts) {
    const auto& edp = layout_.expert_dp.defined() ? layout_.expert_dp : layout_.replicas();
    expert_zero_ = std::make_unique<commgrad::optim::ZeroOptimizer>(
        model_, make_adamw,
        commgrad::optim::ZeroOptimizerOptions(commgrad::moe::expert_ddp_options(*model_, layout_.replicas(), edp))
            .stage(2)
            .mixed_precision(policy)
            .tensor_parallel_group(layout_.tp));  // experts are TP-replicated: their squares counted once
    ddp = commgrad::moe::dense_ddp_options(*model_, layout_.replicas(), ddp);
  }
  zero_ = std::make_unique<commgrad::optim::ZeroOptimizer>(
      model_, make_adamw,
      commgrad::optim::ZeroOptimizerOptions(ddp)
          .stage(2)
          .mixed_precision(policy)
          .loss_scaler(scaler_.get())  // fp16: unscaled and skipped together
          .max_grad_norm(kMaxGradNorm)
          .clip_partner(expert_zero_.get())  // one global norm over dense and expert parameters
          .clip_partner_group(model_->config().ep_group)
          .tensor_parallel_group(layout_.tp)
          .pipeline_parallel_group(layout_.pp)
          .tied_parameters(model_->tied_parameters())
          .tied_group(layout_.embedding));
}

double Trainer::step(const Corpus& corpus, int k) {
  auto [x, y] = corpus.batch(k, options_.batch, model_->config().sequence);
  const int replicas = layout_.dp.size();
  const int replica = layout_.dp.rank();
  x = x.chunk(replicas, 0)[replica];
  y = y.chunk(replicas, 0)[replica];
  if (layout_.cp.defined() && layout_.cp.size() > 1) {  // this rank's head-tail part of every sequence
    x = commgrad::cp::shard_sequence(x, 1, commgrad::cp::SequenceLayout::kHeadTail, layout_.cp);
    y = commgrad::cp::shard_sequence(y, 1, commgrad::cp::SequenceLayout::kHeadTail, layout_.cp);
  }
  const int64_t skipped_before = scaler_ ? scaler_->skipped_steps() : 0;
  step_ = k + 1;
  // The routers' injected losses: averaged over the microbatches as the
  // pipeline averages the loss, and scaled as the loss is under fp16.
  const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
  commgrad::moe::set_aux_loss_scale(*model_, loss_scale / options_.microbatches);
  grad_norm_ = std::numeric_limits<double>::quiet_NaN();  // a skipped step keeps it
  if (options_.fsdp) {
    optimizer_->zero_grad();
    last_ = pipe_->step(x, y);
    step_sharded();
  } else {
    zero_->zero_grad();
    if (expert_zero_) expert_zero_->zero_grad();
    last_ = pipe_->step(x, y);
    if (scaler_) unscale_losses(scaler_->scale());  // before step() updates the scale
    grad_norm_ = zero_->step();
    if (expert_zero_) expert_zero_->step();
  }
  if (scaler_ && scaler_->skipped_steps() > skipped_before) skipped_.push_back(k + 1);
  grad_norms_[k + 1] = grad_norm_;
  if (model_->config().routing.expert_bias_rate() > 0) commgrad::moe::update_expert_bias(*model_);
  // Each rank's loss is the mean over its tokens (the same number on every
  // rank): their mean over data x context is the mean over every token.
  return commgrad::ops::raw::all_reduce(torch::full({1}, last_.loss, torch::kDouble),
                                        commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kAvg),
                                        layout_.replicas())
      .wait()
      .item<double>();
}

void Trainer::inspect_gradients(GradientInspector inspect) {
  inspect_ = std::move(inspect);
  if (options_.fsdp) return;  // step_sharded() calls it
  for (auto* zero : {zero_.get(), expert_zero_.get()}) {
    if (zero == nullptr) continue;
    zero->register_gradient_hook(
        [this](const std::vector<commgrad::optim::ZeroOptimizer::StateShard>& grads) { inspect_zero(grads); });
  }
}

void Trainer::inspect(const std::vector<checkpoint::TensorPiece>& gradients) const {
  if (inspect_) inspect_(step_, gradients);
}

// A ZeroOptimizer's ranges of the gradients as pieces of the whole parameters.
void Trainer::inspect_zero(const std::vector<commgrad::optim::ZeroOptimizer::StateShard>& gradients) const {
  const auto params = model_->named_parameters();
  std::vector<checkpoint::TensorPiece> pieces;
  for (const auto& g : gradients) {
    const auto& param = params[g.param];
    for (auto& p : checkpoint::range_pieces(checkpoint::parameter_blocks(*model_, g.param, param), g.param,
                                            g.param_begin, g.tensor)) {
      pieces.push_back(std::move(p));
    }
  }
  inspect(pieces);
}

std::vector<checkpoint::TensorPiece> Trainer::parameter_pieces() const {
  auto pieces = options_.fsdp ? checkpoint::fsdp_pieces(sharded_, "") : checkpoint::module_pieces(*model_, "");
  const auto buffers = model_->named_buffers();
  std::vector<checkpoint::TensorPiece> out;
  for (auto& p : pieces) {
    if (!buffers.contains(p.name)) out.push_back(std::move(p));
  }
  return out;
}

std::vector<commgrad::pp::NoSyncFunction> Trainer::no_sync_functions() {
  if (options_.fsdp) return {commgrad::pp::no_sync_of(sharded_)};
  if (!expert_zero_) return {commgrad::pp::no_sync_of(*zero_)};
  // One function per stage: both optimizers' guards held together.
  auto dense = commgrad::pp::no_sync_of(*zero_), experts = commgrad::pp::no_sync_of(*expert_zero_);
  return {[dense, experts]() -> std::shared_ptr<void> {
    return std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(dense(), experts());
  }};
}

// Clips and steps this rank's pieces (unscaled first and skipped on every
// rank together when any gradient is inf/NaN, under fp16).
void Trainer::step_sharded() {
  sharded_.finish_gradients();
  // fp16: unscaled, and the inf/NaN check agreed, before anyone looks.
  bool found_inf = false;
  if (scaler_) {
    unscale_losses(scaler_->scale());
    std::vector<torch::Tensor> grads;
    for (const auto& p : model_->parameters()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    found_inf = scaler_->unscale_and_check(grads);
  }
  if (inspect_) inspect(checkpoint::fsdp_gradient_pieces(sharded_, ""));
  if (!found_inf) {
    grad_norm_ = sharded_.clip_grad_norm_(kMaxGradNorm, layout_.tp, layout_.pp);
    optimizer_->step();
  }
  if (scaler_) scaler_->update(found_inf);
}

// The pipeline reports the scaled loss (fp16).
void Trainer::unscale_losses(double scale) {
  last_.loss /= scale;
  for (auto& l : last_.microbatch_losses) l /= scale;
}

// FSDP and ZeRO-2 write the same format: a checkpoint of either loads into
// either. The experts' optimizer writes under "expert_optim/"; expert
// parameters are named by their global index, so their pieces (and their
// optimizer's ranges over the expert-data group) load at any EP or DP size.
void Trainer::save(const std::string& root, int step, const std::string& layout) {
  auto pieces = options_.fsdp ? checkpoint::fsdp_pieces(sharded_) : checkpoint::module_pieces(*model_);
  auto optim =
      options_.fsdp ? checkpoint::fsdp_optimizer_pieces(sharded_, *optimizer_) : checkpoint::optimizer_pieces(*zero_);
  pieces.insert(pieces.end(), optim.begin(), optim.end());
  if (expert_zero_) {
    for (auto& p : checkpoint::optimizer_pieces(*expert_zero_, kExpertOptim)) pieces.push_back(std::move(p));
  }
  if (scaler_) {
    for (auto& p : checkpoint::loss_scaler_pieces(*scaler_)) pieces.push_back(std::move(p));
  }
  if (!options_.async_save) {
    checkpoint::save(root, step, pieces, {{"layout", layout}}, checkpoint::SaveOptions().keep(2));
    return;
  }
  if (!saver_) saver_ = std::make_unique<checkpoint::AsyncSaver>(commgrad::world());  // every rank saves
  saver_->save(root, step, pieces, {{"layout", layout}}, checkpoint::SaveOptions().keep(2));
}

void Trainer::finish_saves() {
  if (saver_) saver_->wait();
}

namespace {

// Moves `part` to the end of `all`; returns where it starts there.
size_t append(std::vector<checkpoint::TensorPiece>& all, std::vector<checkpoint::TensorPiece> part) {
  const size_t begin = all.size();
  for (auto& p : part) all.push_back(std::move(p));
  return begin;
}

// The pieces [begin, end) of `all`.
std::vector<checkpoint::TensorPiece> slice(const std::vector<checkpoint::TensorPiece>& all, size_t begin, size_t end) {
  return {all.begin() + static_cast<std::ptrdiff_t>(begin), all.begin() + static_cast<std::ptrdiff_t>(end)};
}

}  // namespace

std::pair<int, std::string> Trainer::load(const std::string& root, std::optional<int64_t> step) {
  std::vector<checkpoint::TensorPiece> all;
  append(all, options_.fsdp ? checkpoint::fsdp_pieces(sharded_) : checkpoint::module_pieces(*model_));
  const size_t optim = append(all, options_.fsdp ? checkpoint::fsdp_optimizer_load_pieces(sharded_, *optimizer_)
                                                 : checkpoint::optimizer_load_pieces(*zero_));
  const size_t experts = append(all, expert_zero_ ? checkpoint::optimizer_load_pieces(*expert_zero_, kExpertOptim)
                                                  : std::vector<checkpoint::TensorPiece>{});
  const size_t scaler =
      append(all, scaler_ ? checkpoint::loss_scaler_pieces(*scaler_) : std::vector<checkpoint::TensorPiece>{});
  const auto result = checkpoint::load(root, all, checkpoint::LoadOptions().step(step));
  if (scaler_) checkpoint::restore_loss_scaler(*scaler_, slice(all, scaler, all.size()), result);
  if (options_.fsdp) {
    checkpoint::restore_fsdp_optimizer(sharded_, *optimizer_, slice(all, optim, experts), result);
  } else {
    checkpoint::restore_optimizer(*zero_, slice(all, optim, experts), result);
  }
  if (expert_zero_) checkpoint::restore_optimizer(*expert_zero_, slice(all, experts, scaler), result, kExpertOptim);
  return {static_cast<int>(result.step), result.metadata.value("layout", std::string("?"))};
}

}  // namespace gpt
