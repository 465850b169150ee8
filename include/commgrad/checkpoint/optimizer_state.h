#pragma once
// A ZeroOptimizer's sharded state in a checkpoint, in the coordinates of the
// unsplit model, so that it loads under another data- or tensor-parallel
// layout.
//
// Each rank holds, per state tensor (exp_avg, exp_avg_sq, momentum_buffer,
// ..., "master" for float32 master weights), a flat range of each parameter
// its ranges touch. That range of the parameter's local (TP) tensor becomes
// a piece named prefix + "<state>/<param>" ("optim/exp_avg/fc1.weight"):
// the parameter's box in the global tensor (as module_pieces() has it) and
// the range of that box's elements. The step count is prefix + "step". At
// load, load() assembles each destination range from whatever ranges other
// layouts saved.

#include "commgrad/checkpoint/load.h"
#include "commgrad/checkpoint/tensor_piece.h"

#include <string>
#include <vector>

namespace commgrad::optim {
class ZeroOptimizer;
}  // namespace commgrad::optim

namespace commgrad::checkpoint {

/// The pieces of `zero`'s state for save() (views, no copies). Empty before
/// the optimizer's first step but for the step count.
///
/// Example:
///   auto pieces = checkpoint::module_pieces(*model);
///   auto optim = checkpoint::optimizer_pieces(zero);
///   pieces.insert(pieces.end(), optim.begin(), optim.end());
///   checkpoint::save("ckpt", step, pieces);
std::vector<TensorPiece> optimizer_pieces(optim::ZeroOptimizer& zero, const std::string& prefix = "optim/");

/// Destination pieces for load(): this rank's ranges of every state tensor
/// the optimizer can keep (those the checkpoint lacks are skipped, e.g.
/// max_exp_avg_sq without amsgrad). Pass them to load() with the others,
/// then call restore_optimizer().
///
/// Example:
///   auto optim = checkpoint::optimizer_load_pieces(zero);
///   auto result = checkpoint::load("ckpt", optim);
///   checkpoint::restore_optimizer(zero, optim, result);
std::vector<TensorPiece> optimizer_load_pieces(optim::ZeroOptimizer& zero, const std::string& prefix = "optim/");

/// Hands what load() wrote into `pieces` (from optimizer_load_pieces() with
/// the same prefix) to the optimizer. Errors when the checkpoint holds no
/// optimizer state under `prefix`, or only part of a state tensor.
void restore_optimizer(optim::ZeroOptimizer& zero, const std::vector<TensorPiece>& pieces, const LoadResult& result,
                       const std::string& prefix = "optim/");

}  // namespace commgrad::checkpoint
