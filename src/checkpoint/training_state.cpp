// save_training_state / load_training_state: every piece of a training run
// (model, optimizer, RNG streams, loss scaler) taken when the call runs, saved
// or loaded in one collective save() / load(), then handed to the objects
// that restore from their pieces (restore_optimizer, restore_rng, ...).
// The pieces of each part sit in one list in a fixed order (model,
// optimizer, rng, scaler); `Parts` remembers where each part starts.

#include "commgrad/checkpoint/training_state.h"

#include "commgrad/checkpoint/fsdp_state.h"
#include "commgrad/checkpoint/loss_scaler_state.h"
#include "commgrad/checkpoint/module_state.h"
#include "commgrad/checkpoint/optimizer_state.h"
#include "commgrad/checkpoint/rng_state.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/fsdp/fully_shard.h"
#include "commgrad/tp/random.h"
#include "commgrad/tp/wiring_checks.h"

#include <torch/nn/module.h>

namespace commgrad::checkpoint {
namespace {

constexpr const char* kTrainingStateOp = "checkpoint training state";

// One list of pieces and where each part of it starts.
struct Parts {
  std::vector<TensorPiece> all;
  size_t optim_begin = 0, rng_begin = 0, scaler_begin = 0;

  void add(std::vector<TensorPiece> pieces) {
    for (auto& p : pieces) all.push_back(std::move(p));
  }
  std::vector<TensorPiece> range(size_t begin, size_t end) const {
    return std::vector<TensorPiece>(all.begin() + static_cast<std::ptrdiff_t>(begin),
                                    all.begin() + static_cast<std::ptrdiff_t>(end));
  }
  std::vector<TensorPiece> optim() const { return range(optim_begin, rng_begin); }
  std::vector<TensorPiece> rng() const { return range(rng_begin, scaler_begin); }
  std::vector<TensorPiece> scaler() const { return range(scaler_begin, all.size()); }
};

Group rng_group(const torch::nn::Module& model, const TrainingStateOptions& options) {
  if (options.tensor_parallel_group().defined()) return options.tensor_parallel_group();
  const Group g = tp::tensor_parallel_group_for_norm(model, default_tensor_parallel_group(), kTrainingStateOp);
  return g.defined() ? g : self_group();
}

// Adds the RNG and scaler parts after the model's and the optimizer's.
void add_rest(Parts& parts, const torch::nn::Module& model, const TrainingStateOptions& options) {
  parts.rng_begin = parts.all.size();
  if (options.rng()) parts.add(rng_pieces(tp::rng_tracker(), rng_group(model, options)));
  parts.scaler_begin = parts.all.size();
  if (options.loss_scaler() != nullptr) parts.add(loss_scaler_pieces(*options.loss_scaler()));
}

SaveResult save_parts(const std::string& root, int64_t step, const Parts& parts, const nlohmann::json& metadata,
                      const TrainingStateOptions& options) {
  return save(root, step, parts.all, metadata, SaveOptions().keep(options.keep()), options.group());
}

LoadResult load_parts(const std::string& root, const Parts& parts, const TrainingStateOptions& options) {
  return load(root, parts.all, LoadOptions().step(options.step()), options.group());
}

void restore_rest(const Parts& parts, const LoadResult& result, const TrainingStateOptions& options) {
  if (options.rng()) restore_rng(tp::rng_tracker(), parts.rng(), result);
  if (options.loss_scaler() != nullptr) restore_loss_scaler(*options.loss_scaler(), parts.scaler(), result);
}

}  // namespace

SaveResult save_training_state(const std::string& root, int64_t step, const torch::nn::Module& model,
                               optim::ZeroOptimizer& zero, const nlohmann::json& metadata,
                               const TrainingStateOptions& options) {
  Parts parts;
  parts.add(module_pieces(model));
  parts.optim_begin = parts.all.size();
  parts.add(optimizer_pieces(zero));
  add_rest(parts, model, options);
  return save_parts(root, step, parts, metadata, options);
}

LoadResult load_training_state(const std::string& root, torch::nn::Module& model, optim::ZeroOptimizer& zero,
                               const TrainingStateOptions& options) {
  Parts parts;
  parts.add(module_pieces(model));
  parts.optim_begin = parts.all.size();
  parts.add(optimizer_load_pieces(zero));
  add_rest(parts, model, options);
  const auto result = load_parts(root, parts, options);
  restore_optimizer(zero, parts.optim(), result);
  restore_rest(parts, result, options);
  return result;
}

SaveResult save_training_state(const std::string& root, int64_t step, const fsdp::FullyShardedModule& model,
                               torch::optim::Optimizer& optimizer, const nlohmann::json& metadata,
                               const TrainingStateOptions& options) {
  Parts parts;
  parts.add(fsdp_pieces(model));
  parts.optim_begin = parts.all.size();
  parts.add(fsdp_optimizer_pieces(model, optimizer));
  add_rest(parts, *model.module(), options);
  return save_parts(root, step, parts, metadata, options);
}

LoadResult load_training_state(const std::string& root, const fsdp::FullyShardedModule& model,
                               torch::optim::Optimizer& optimizer, const TrainingStateOptions& options) {
  Parts parts;
  parts.add(fsdp_pieces(model));
  parts.optim_begin = parts.all.size();
  parts.add(fsdp_optimizer_load_pieces(model, optimizer));
  add_rest(parts, *model.module(), options);
  const auto result = load_parts(root, parts, options);
  restore_fsdp_optimizer(model, optimizer, parts.optim(), result);
  restore_rest(parts, result, options);
  return result;
}

LoadResult load_model_weights(const std::string& root, torch::nn::Module& model, const LoadOptions& options,
                              const Group& group) {
  // load()'s strict mode counts only the sections some rank loads: here "model/".
  return load(root, module_pieces(model), options, group);
}

}  // namespace commgrad::checkpoint
