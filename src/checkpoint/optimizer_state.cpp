// A ZeroOptimizer's sharded state as checkpoint pieces (see the header).
//
// A state range covers elements [b, b + n) of a parameter's flattened local
// tensor. The local tensor is one box of the global tensor, or, for a
// strided partition along dim 0, k boxes that follow each other in the
// flattening; a range then becomes one piece per box it touches.

#include "commgrad/checkpoint/optimizer_state.h"

#include "detail/state_runs.h"

#include "commgrad/checkpoint/module_state.h"
#include "commgrad/optim/zero_optimizer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>

namespace commgrad::checkpoint {
using detail::state_name;

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
  detail::StateRuns runs(pieces, result, "restore_optimizer", "optimizer_load_pieces()");
  std::vector<optim::ZeroOptimizer::StateShard> shards;
  for (const auto& shard : zero.shards()) {
    for (const auto& seg : shard.segments) {
      // A range's pieces (one per TP block it touches) are the next run of
      // each state's name; a parameter has one range per rank.
      for (const auto& state : zero.state_names()) {
        if (auto value = runs.take(prefix, state, seg.name))
          shards.push_back({seg.name, state, seg.param_begin, *value});
      }
    }
  }
  const int64_t step = runs.step(prefix, runs.position());
  runs.check_complete("ranges");
  zero.load_state_shards(shards, step);
}

}  // namespace commgrad::checkpoint
