#pragma once
// A fully_shard model and its optimizer in a checkpoint, in the coordinates
// of the unsplit model, so that it loads under another data- or
// tensor-parallel layout, under DistributedDataParallel or ZeroOptimizer,
// and the other way round.
//
// Each rank holds, per parameter, a flat range of the parameter's local
// (tensor-parallel) tensor: its piece of the unit's shard. That range
// becomes a piece named prefix + "<param>" of the parameter's box in the
// global tensor (as module_pieces() has it), with the range of the box's
// elements: the format ZeroOptimizer's state already uses, so the
// optimizer's state goes under "optim/<state>/<param>" and "optim/step" as
// ZeroOptimizer's does (optimizer_state.h).

#include "commgrad/checkpoint/load.h"
#include "commgrad/checkpoint/tensor_piece.h"

#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace commgrad::fsdp {
class FullyShardedModule;
}  // namespace commgrad::fsdp

namespace commgrad::checkpoint {

/// The pieces of a sharded model's parameters (this rank's pieces: views,
/// load() writes into the shards in place) and buffers, named as
/// module_pieces() names them.
///
/// Example:
///   auto pieces = checkpoint::fsdp_pieces(sharded);
///   auto optim = checkpoint::fsdp_optimizer_pieces(sharded, opt);
///   pieces.insert(pieces.end(), optim.begin(), optim.end());
///   checkpoint::save("ckpt", step, pieces);
std::vector<TensorPiece> fsdp_pieces(const fsdp::FullyShardedModule& sharded, const std::string& prefix = "model/");

/// The pieces of this rank's sharded gradients (views of the shards'
/// `.grad()`, after finish_gradients(): reduced and divided), named prefix +
/// the parameter's name, in the coordinates of the whole model: for checks
/// that compare the gradients with a reference's and for inspection.
/// Pieces without a gradient (frozen, or before backward) are left out.
///
/// Example:
///   sharded.finish_gradients();
///   auto grads = checkpoint::fsdp_gradient_pieces(sharded);   // "grad/layer0.mlp.fc1.weight", ...
std::vector<TensorPiece> fsdp_gradient_pieces(const fsdp::FullyShardedModule& sharded,
                                              const std::string& prefix = "grad/");

/// The pieces of `optimizer`'s state over the sharded model's pieces (any
/// optimizer optim::get_param_state() reads), and its step count. Empty but
/// for the step count before the optimizer's first step.
std::vector<TensorPiece> fsdp_optimizer_pieces(const fsdp::FullyShardedModule& sharded,
                                               torch::optim::Optimizer& optimizer,
                                               const std::string& prefix = "optim/");

/// Destination pieces for load(): every state tensor the optimizer can keep
/// for each piece (those the checkpoint lacks are skipped). Pass them to
/// load() with the others, then call restore_fsdp_optimizer().
std::vector<TensorPiece> fsdp_optimizer_load_pieces(const fsdp::FullyShardedModule& sharded,
                                                    torch::optim::Optimizer& optimizer,
                                                    const std::string& prefix = "optim/");

/// Hands what load() wrote into `pieces` (from fsdp_optimizer_load_pieces()
/// with the same prefix) to the optimizer. Errors when the checkpoint holds
/// no optimizer state under `prefix`, or a state for only some parameters.
void restore_fsdp_optimizer(const fsdp::FullyShardedModule& sharded, torch::optim::Optimizer& optimizer,
                            const std::vector<TensorPiece>& pieces, const LoadResult& result,
                            const std::string& prefix = "optim/");

}  // namespace commgrad::checkpoint
