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

/// Where one block of a parameter's local tensor sits in the global tensor
/// (a parameter that is not partitioned, or partitioned with stride 1, is one
/// block: the whole local tensor).
struct ParameterBlock {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offset;  ///< of the block in the global tensor
  std::vector<int64_t> shape;
  int64_t dim = 0;          ///< the partition dim (0 when not partitioned)
  int64_t local_start = 0;  ///< where the block starts along `dim` in the local tensor
};

/// The blocks of parameter `name` (local tensor `local`) of `module`, from
/// tp::shard_specs(module) (module_pieces() makes one piece per block).
std::vector<ParameterBlock> parameter_blocks(const torch::nn::Module& module, const std::string& name,
                                             const at::Tensor& local);

/// The pieces, named `name`, of elements [begin, begin + data.numel()) of a
/// parameter's flattened local tensor made of `blocks` (a ZeRO optimizer's
/// range of a state, an FSDP rank's piece of a parameter): one per block the
/// range touches; `data` holds the elements.
std::vector<TensorPiece> range_pieces(const std::vector<ParameterBlock>& blocks, const std::string& name, int64_t begin,
                                      const at::Tensor& data, bool required = true);

}  // namespace commgrad::checkpoint
