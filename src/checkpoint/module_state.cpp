// module_pieces: a module's parameters and buffers as checkpoint pieces.
//
// A partitioned parameter of local size L along dim d on rank r of n, with
// stride k, is k blocks of b = L / k rows; block j sits at global offset
// (r + j n) b along d (Megatron's strided layout, tp/sharding.h). Each block
// is one piece: a narrow() view of the parameter, so no data is copied here.

#include "commgrad/checkpoint/module_state.h"

#include "commgrad/tp/sharding.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>

namespace commgrad::checkpoint {

namespace {

std::vector<ParameterBlock> blocks_of(const std::string& name, const at::Tensor& local,
                                      const tp::ParameterShard& shard) {
  const int n = shard.spec.is_partitioned() && shard.group.defined() ? shard.group.size() : 1;
  const int64_t nd = local.dim();
  if (n == 1) return {ParameterBlock{local.sizes().vec(), std::vector<int64_t>(nd, 0), local.sizes().vec(), 0, 0}};
  const int64_t d = shard.spec.dim < 0 ? shard.spec.dim + nd : shard.spec.dim;
  const int64_t k = shard.spec.stride;
  TORCH_CHECK(d >= 0 && d < nd && k >= 1 && local.size(d) % k == 0, "[commgrad] checkpoint::module_pieces: '", name,
              "' (", shard.spec.describe(), ") cannot be split as its spec says: local shape ", local.sizes());
  const int64_t block = local.size(d) / k;
  std::vector<int64_t> global = local.sizes().vec();
  global[d] *= n;
  std::vector<ParameterBlock> blocks;
  for (int64_t j = 0; j < k; ++j) {
    ParameterBlock b{global, std::vector<int64_t>(nd, 0), local.sizes().vec(), d, j * block};
    b.offset[d] = (shard.group.rank() + j * n) * block;
    b.shape[d] = block;
    blocks.push_back(std::move(b));
  }
  return blocks;
}

}  // namespace

std::vector<ParameterBlock> parameter_blocks(const torch::nn::Module& module, const std::string& name,
                                             const at::Tensor& local) {
  const auto specs = tp::shard_specs(module);
  TORCH_CHECK(specs.contains(name), "[commgrad] checkpoint: the module has no parameter '", name, "'");
  return blocks_of(name, local, specs[name]);
}

std::vector<TensorPiece> module_pieces(const torch::nn::Module& module, const std::string& prefix) {
  std::vector<TensorPiece> pieces;
  const auto specs = tp::shard_specs(module);
  for (const auto& p : module.named_parameters()) {
    const at::Tensor local = p.value().detach();
    const auto blocks = blocks_of(p.key(), local, specs[p.key()]);
    if (blocks.size() == 1 && blocks[0].shape == blocks[0].global_shape) {
      pieces.push_back(TensorPiece::whole(prefix + p.key(), local));  // not split (also 0-dim tensors)
      pieces.back().source = p.value();
      continue;
    }
    for (const auto& b : blocks) {
      TensorPiece piece;
      piece.name = prefix + p.key();
      piece.global_shape = b.global_shape;
      piece.box_offset = b.offset;
      piece.box_shape = b.shape;
      piece.tensor = local.narrow(b.dim, b.local_start, b.shape[b.dim]);
      piece.source = p.value();
      pieces.push_back(std::move(piece));
    }
  }
  for (const auto& b : module.named_buffers()) pieces.push_back(TensorPiece::whole(prefix + b.key(), b.value()));
  return pieces;
}

std::vector<TensorPiece> range_pieces(const std::vector<ParameterBlock>& blocks, const std::string& name, int64_t begin,
                                      const at::Tensor& data, bool required) {
  const int64_t length = data.numel();
  std::vector<TensorPiece> pieces;
  auto piece = [&](const ParameterBlock& b, int64_t flat_begin, const at::Tensor& tensor) {
    TensorPiece p;
    p.name = name;
    p.global_shape = b.global_shape;
    if (!b.shape.empty()) {
      p.box_offset = b.offset;
      p.box_shape = b.shape;
    }
    p.flat_begin = flat_begin;
    p.flat_end = flat_begin + tensor.numel();
    p.tensor = tensor;
    p.required = required;
    pieces.push_back(std::move(p));
  };
  if (blocks.size() == 1) {
    piece(blocks[0], begin, data);
    return pieces;
  }
  TORCH_CHECK(blocks[0].dim == 0, "[commgrad] checkpoint: '", name, "', partitioned with a stride along dim ",
              blocks[0].dim, ": only strided partitions along dim 0 can hold flat ranges");
  int64_t per_block = 1;
  for (int64_t extent : blocks[0].shape) per_block *= extent;
  for (size_t j = 0; j < blocks.size(); ++j) {
    const int64_t lo = std::max<int64_t>(begin, j * per_block);
    const int64_t hi = std::min<int64_t>(begin + length, (j + 1) * per_block);
    if (lo < hi) piece(blocks[j], lo - j * per_block, data.narrow(0, lo - begin, hi - lo));
  }
  return pieces;
}

}  // namespace commgrad::checkpoint
