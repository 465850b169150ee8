#pragma once
// A training run's whole state in one call each: the model, its optimizer,
// the tensor-parallel RNG streams, the loss scaler, the step and the user's
// metadata, saved and loaded as checkpoint::save() / load() do (every rank,
// any layout at load).
//
// The pieces are taken inside the call, from the objects as they are then:
// none can be stale (pieces taken before a ZeroOptimizer re-pointed the
// parameters used to load into tensors the model no longer held, and the
// weights silently stayed at their initial values).
//
//   name              what                                   from
//   model/<param>     parameters and buffers                 module_pieces() / fsdp_pieces()
//   optim/<state>/..  the optimizer's sharded state, step    optimizer_pieces() / fsdp_optimizer_pieces()
//   rng/...           tp::rng_tracker()'s streams            rng_pieces()
//   scaler/...        a DynamicLossScaler, when given        loss_scaler_pieces()
//
// load_model_weights() reads the "model/" pieces alone (evaluation, or a
// fine-tuning run with a new optimizer), strict about the model's tensors.

#include "commgrad/checkpoint/load.h"
#include "commgrad/checkpoint/save.h"
#include "commgrad/dist/group.h"

#include <nlohmann/json.hpp>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim
namespace commgrad::optim {
class ZeroOptimizer;
class DynamicLossScaler;
}  // namespace commgrad::optim
namespace commgrad::fsdp {
class FullyShardedModule;
}  // namespace commgrad::fsdp

namespace commgrad::checkpoint {

/// Options of save_training_state() / load_training_state().
///
/// Example:
///   checkpoint::TrainingStateOptions().keep(2).loss_scaler(&scaler)
struct TrainingStateOptions {
  using LossScalerPtr = optim::DynamicLossScaler*;
  /// Save and restore tp::rng_tracker()'s streams.
  TORCH_ARG(bool, rng) = true;
  /// The tensor-parallel group of the RNG streams. Undefined: the current
  /// layout's when its TP size is above 1, else the group the model's
  /// partitioned parameters are split over, else this rank alone.
  TORCH_ARG(Group, tensor_parallel_group);
  /// A loss scaler whose state travels with the rest (not owned).
  TORCH_ARG(LossScalerPtr, loss_scaler) = nullptr;
  /// save: keep only the newest `keep` complete steps (0: all).
  TORCH_ARG(int64_t, keep) = 0;
  /// load: the step to load; nullopt: the latest.
  TORCH_ARG(std::optional<int64_t>, step) = std::nullopt;
  /// The ranks that save and load together (undefined: the world).
  TORCH_ARG(Group, group);
};

/// Saves the model's parameters and buffers, `zero`'s state, the RNG
/// streams (and the loss scaler) as step `step` under `root`, with
/// `metadata` (any JSON: the epoch, the data position). Collective over
/// options.group(); errors on every rank as save() does.
///
/// Example:
///   checkpoint::save_training_state("ckpt", step, *model, zero, {{"epoch", epoch}});
SaveResult save_training_state(const std::string& root, int64_t step, const torch::nn::Module& model,
                               optim::ZeroOptimizer& zero, const nlohmann::json& metadata = nlohmann::json::object(),
                               const TrainingStateOptions& options = {});

/// Loads what save_training_state() saved, under any layout: the model's
/// parameters and buffers in place, `zero`'s state, the RNG streams (and
/// the loss scaler). Returns the step and the metadata. Build the model and
/// the optimizer first, in any order. Collective; errors on every rank (and
/// changes nothing) as load() does.
///
/// Example:
///   const auto loaded = checkpoint::load_training_state("ckpt", *model, zero);
///   int64_t step = loaded.step;
///   int epoch = loaded.metadata.at("epoch");
LoadResult load_training_state(const std::string& root, torch::nn::Module& model, optim::ZeroOptimizer& zero,
                               const TrainingStateOptions& options = {});

/// The same for a fully_shard model and the torch::optim optimizer over
/// its pieces.
///
/// Example:
///   checkpoint::save_training_state("ckpt", step, sharded, adam);
SaveResult save_training_state(const std::string& root, int64_t step, const fsdp::FullyShardedModule& model,
                               torch::optim::Optimizer& optimizer,
                               const nlohmann::json& metadata = nlohmann::json::object(),
                               const TrainingStateOptions& options = {});
LoadResult load_training_state(const std::string& root, const fsdp::FullyShardedModule& model,
                               torch::optim::Optimizer& optimizer, const TrainingStateOptions& options = {});

/// Loads only the model's parameters and buffers ("model/" pieces) from a
/// checkpoint, a training one included: strict about the model's tensors
/// (each must be in the checkpoint, and the checkpoint may hold no other
/// "model/" tensor), indifferent to the optimizer's, the RNG's and the
/// scaler's. Any layout. Collective over `group` (undefined: the world).
///
/// Example:
///   tp::ParallelMLP mlp(...);                                  // for evaluation, any TP size
///   checkpoint::load_model_weights("ckpt", *mlp);
LoadResult load_model_weights(const std::string& root, torch::nn::Module& model, const LoadOptions& options = {},
                              const Group& group = Group());

}  // namespace commgrad::checkpoint
