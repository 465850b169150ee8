#pragma once
// The pieces of a module's parameters and buffers, in the coordinates of the
// unsplit model, so that a checkpoint saved at one tensor-parallel size loads
// at another.
//
// For each parameter, tp::shard_specs() says how it is split over its TP
// group: replicated parameters and buffers are one piece, the whole tensor;
// a parameter partitioned along dim d over n ranks is this rank's box of the
// global tensor (size along d times n); a strided partition (stride k:
// blocks r, r + n, ... of size S / (k n)) is k pieces, one per block.
//
// Who writes: every rank lists all its pieces; save() writes identical
// pieces once (the lowest rank's), which covers both TP-replicated tensors
// and the copies on data-parallel ranks. No data-parallel group is needed.

#include "commgrad/checkpoint/tensor_piece.h"

#include <string>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace commgrad::checkpoint {

/// The pieces of `module`'s parameters and buffers, named prefix + the name
/// named_parameters() / named_buffers() give them ("model/fc1.weight"). The
/// tensors are detached views of the module's own: save() reads them, load()
/// writes into them (the module is updated in place).
///
/// Example:
///   tp::ParallelMLP mlp(tp::ParallelMLPOptions(64, 256, state.tensor_parallel_group()));
///   checkpoint::save("ckpt", 10, checkpoint::module_pieces(*mlp));
///   // later, at any TP size:
///   checkpoint::load("ckpt", checkpoint::module_pieces(*mlp));
std::vector<TensorPiece> module_pieces(const torch::nn::Module& module, const std::string& prefix = "model/");

}  // namespace commgrad::checkpoint
