#include "trainer.h"

#include <vector>

namespace gpt {

namespace checkpoint = commgrad::checkpoint;

Trainer::Trainer(const TrainerOptions& options, const GptConfig& model_config, const Layout& layout)
    : options_(options),
      layout_(layout),
      model_(model_config, layout.pp.rank(), layout.pp.size(), options.stages_per_rank, layout.tp) {
  make_optimizer();
  std::vector<commgrad::pp::StageFunction> stages;
  for (int v = 0; v < options.stages_per_rank; ++v) {
    stages.push_back([model = model_, v](const torch::Tensor& x) mutable { return model->forward_stage(v, x); });
  }
  pipe_ = std::make_unique<commgrad::pp::Pipeline>(
      std::move(stages),
      [model = model_](const torch::Tensor& logits, const torch::Tensor& y) { return model->loss(logits, y); },
      commgrad::pp::PipelineOptions(options.microbatches)
          .schedule(layout.pp.size() == 1 && options.schedule == "interleaved" ? "1f1b" : options.schedule)
          .stages_per_rank(options.stages_per_rank)
          .group(layout.pp)
          .no_sync({options.fsdp ? commgrad::pp::no_sync_of(sharded_) : commgrad::pp::no_sync_of(*zero_)}));
}

void Trainer::make_optimizer() {
  const auto adamw = torch::optim::AdamWOptions(3e-3).weight_decay(0.01);
  if (options_.fsdp) {
    sharded_ = model_->fully_shard(commgrad::fsdp::FullyShardOptions(layout_.dp), layout_.embedding);
    optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(), adamw);
    return;
  }
  zero_ = std::make_unique<commgrad::optim::ZeroOptimizer>(
      model_,
      [adamw](std::vector<torch::Tensor> shards) { return std::make_unique<torch::optim::AdamW>(shards, adamw); },
      commgrad::optim::ZeroOptimizerOptions(commgrad::dp::DistributedDataParallelOptions(layout_.dp))
          .stage(2)
          .max_grad_norm(1.0)
          .tensor_parallel_group(layout_.tp)
          .pipeline_parallel_group(layout_.pp)
          .tied_parameters(model_->tied_parameters())
          .tied_group(layout_.embedding));
}

double Trainer::step(const Corpus& corpus, int k) {
  auto [x, y] = corpus.batch(k, options_.batch, model_->config().sequence);
  const int replicas = layout_.dp.size();
  const int replica = layout_.dp.rank();
  if (options_.fsdp) {
    optimizer_->zero_grad();
    last_ = pipe_->step(x.chunk(replicas, 0)[replica], y.chunk(replicas, 0)[replica]);
    sharded_.finish_gradients();
    sharded_.clip_grad_norm_(1.0, layout_.tp, layout_.pp);
    optimizer_->step();
  } else {
    zero_->zero_grad();
    last_ = pipe_->step(x.chunk(replicas, 0)[replica], y.chunk(replicas, 0)[replica]);
    zero_->step();
  }
  return commgrad::ops::raw::all_reduce(torch::full({1}, last_.loss, torch::kDouble),
                                        commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kAvg), layout_.dp)
      .wait()
      .item<double>();
}

// FSDP and ZeRO-2 write the same format: a checkpoint of either loads into either.
void Trainer::save(const std::string& root, int step, const std::string& layout) {
  auto pieces = options_.fsdp ? checkpoint::fsdp_pieces(sharded_) : checkpoint::module_pieces(*model_);
  auto optim = options_.fsdp ? checkpoint::fsdp_optimizer_pieces(sharded_, *optimizer_)
                             : checkpoint::optimizer_pieces(*zero_);
  pieces.insert(pieces.end(), optim.begin(), optim.end());
  checkpoint::save(root, step, pieces, {{"layout", layout}}, checkpoint::SaveOptions().keep(2));
}

std::pair<int, std::string> Trainer::load(const std::string& root) {
  auto model = options_.fsdp ? checkpoint::fsdp_pieces(sharded_) : checkpoint::module_pieces(*model_);
  auto optim = options_.fsdp ? checkpoint::fsdp_optimizer_load_pieces(sharded_, *optimizer_)
                             : checkpoint::optimizer_load_pieces(*zero_);
  auto all = model;
  all.insert(all.end(), optim.begin(), optim.end());
  const auto result = checkpoint::load(root, all);
  const std::vector<checkpoint::TensorPiece> loaded(all.begin() + model.size(), all.end());
  if (options_.fsdp) {
    checkpoint::restore_fsdp_optimizer(sharded_, *optimizer_, loaded, result);
  } else {
    checkpoint::restore_optimizer(*zero_, loaded, result);
  }
  return {static_cast<int>(result.step), result.metadata.value("layout", std::string("?"))};
}

}  // namespace gpt
