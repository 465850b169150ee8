// A ZeroOptimizer's sharded state as checkpoint pieces (see the header).
//
// A state range covers elements [b, b + n) of a parameter's flattened local
// tensor. The local tensor is one box of the global tensor, or, for a
// strided partition along dim 0, k boxes that follow each other in the
// flattening; a range then becomes one piece per box it touches.

#include "commgrad/checkpoint/optimizer_state.h"

#include "commgrad/checkpoint/module_state.h"
#include "commgrad/optim/zero_optimizer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>

namespace commgrad::checkpoint {
namespace {

std::string state_name(const std::string& prefix, const std::string& state, const std::string& param) {
  return prefix + state + "/" + param;
}

}  // namespace

std::vector<TensorPiece> optimizer_pieces(optim::ZeroOptimizer& zero, const std::string& prefix) {
  const auto& module = *zero.ddp().module();
  std::vector<TensorPiece> pieces;
  for (const auto& s : zero.state_shards()) {
    auto more = range_pieces(parameter_blocks(module, s.param, module.named_parameters()[s.param]),
                             state_name(prefix, s.state, s.param), s.param_begin, s.tensor, true);
    pieces.insert(pieces.end(), more.begin(), more.end());
  }
  pieces.push_back(TensorPiece::whole(prefix + "step", at::full({1}, zero.step_count(), at::kLong)));
  return pieces;
}

std::vector<TensorPiece> optimizer_load_pieces(optim::ZeroOptimizer& zero, const std::string& prefix) {
  const auto& module = *zero.ddp().module();
  const auto names = zero.state_names();
  std::vector<TensorPiece> pieces;
  for (const auto& shard : zero.shards()) {
    for (const auto& seg : shard.segments) {
      for (const auto& state : names) {
        auto data = at::zeros({seg.length}, at::TensorOptions().dtype(shard.state_dtype));
        auto more = range_pieces(parameter_blocks(module, seg.name, module.named_parameters()[seg.name]),
                                 state_name(prefix, state, seg.name), seg.param_begin, data, false);
        pieces.insert(pieces.end(), more.begin(), more.end());
      }
    }
  }
  pieces.push_back(TensorPiece::whole(prefix + "step", at::zeros({1}, at::kLong)));
  return pieces;
}

void restore_optimizer(optim::ZeroOptimizer& zero, const std::vector<TensorPiece>& pieces, const LoadResult& result,
                       const std::string& prefix) {
  const std::set<std::string> skipped(result.skipped.begin(), result.skipped.end());
  const auto names = zero.state_names();
  std::vector<optim::ZeroOptimizer::StateShard> shards;
  std::map<std::string, std::pair<int, int>> found;  // state -> (loaded, skipped) ranges
  size_t next = 0;
  for (const auto& shard : zero.shards()) {
    for (const auto& seg : shard.segments) {
      for (const auto& state : names) {
        // In optimizer_load_pieces()'s order: this range's pieces (one per
        // TP block it touches) are the next ones of its name; a parameter
        // has one range per rank, so the run of that name ends there.
        const auto name = state_name(prefix, state, seg.name);
        TORCH_CHECK(next < pieces.size() && pieces[next].name == name, "[commgrad] restore_optimizer: the "
                    "pieces are not those optimizer_load_pieces() made for this optimizer (expected '", name, "')");
        std::vector<at::Tensor> parts;
        for (; next < pieces.size() && pieces[next].name == name; ++next) parts.push_back(pieces[next].tensor.reshape({-1}));
        if (skipped.count(name)) {
          ++found[state].second;
          continue;
        }
        ++found[state].first;
        shards.push_back({seg.name, state, seg.param_begin, parts.size() == 1 ? parts[0] : at::cat(parts)});
      }
    }
  }
  TORCH_CHECK(next < pieces.size() && pieces[next].name == prefix + "step", "[commgrad] restore_optimizer: no '",
              prefix, "step' piece (use optimizer_load_pieces())");
  TORCH_CHECK(!skipped.count(prefix + "step"), "[commgrad] restore_optimizer: the checkpoint in ", result.directory,
              " holds no optimizer state under '", prefix, "'");
  for (const auto& [state, counts] : found) {
    TORCH_CHECK(counts.first == 0 || counts.second == 0, "[commgrad] restore_optimizer: the checkpoint in ",
                result.directory, " holds state '", state, "' for only some of the parameters (", counts.second,
                " of this rank's ranges missing)");
  }
  zero.load_state_shards(shards, pieces[next].tensor.item<int64_t>());
}

}  // namespace commgrad::checkpoint
