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

namespace commgrad::checkpoint {

std::vector<TensorPiece> module_pieces(const torch::nn::Module& module, const std::string& prefix) {
  std::vector<TensorPiece> pieces;
  const auto specs = tp::shard_specs(module);
  for (const auto& p : module.named_parameters()) {
    const at::Tensor local = p.value().detach();
    const tp::ParameterShard& shard = specs[p.key()];
    const int n = shard.spec.is_partitioned() && shard.group.defined() ? shard.group.size() : 1;
    if (n == 1) {
      pieces.push_back(TensorPiece::whole(prefix + p.key(), local));
      continue;
    }
    const int64_t nd = local.dim();
    const int64_t d = shard.spec.dim < 0 ? shard.spec.dim + nd : shard.spec.dim;
    const int64_t k = shard.spec.stride;
    TORCH_CHECK(d >= 0 && d < nd && k >= 1 && local.size(d) % k == 0, "[commgrad] checkpoint::module_pieces: '",
                p.key(), "' (", shard.spec.describe(), ") cannot be split as its spec says: local shape ",
                local.sizes());
    const int64_t block = local.size(d) / k;
    std::vector<int64_t> global = local.sizes().vec();
    global[d] *= n;
    for (int64_t j = 0; j < k; ++j) {
      TensorPiece piece;
      piece.name = prefix + p.key();
      piece.global_shape = global;
      piece.box_offset.assign(nd, 0);
      piece.box_offset[d] = (shard.group.rank() + j * n) * block;
      piece.box_shape = local.sizes().vec();
      piece.box_shape[d] = block;
      piece.tensor = local.narrow(d, j * block, block);
      pieces.push_back(std::move(piece));
    }
  }
  for (const auto& b : module.named_buffers()) pieces.push_back(TensorPiece::whole(prefix + b.key(), b.value()));
  return pieces;
}

}  // namespace commgrad::checkpoint
