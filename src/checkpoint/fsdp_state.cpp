// A fully_shard model and its optimizer as checkpoint pieces (see the header).

#include "commgrad/checkpoint/fsdp_state.h"

#include "commgrad/checkpoint/module_state.h"
#include "commgrad/fsdp/fully_shard.h"
#include "commgrad/optim/param_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <map>
#include <set>

namespace commgrad::checkpoint {
namespace {

// One parameter's piece on this rank, where it sits in the parameter's
// local tensor, and that tensor's blocks in the global one.
struct Piece {
  std::string name;
  at::Tensor param;   // the registered piece (the optimizer's key)
  at::Tensor tensor;  // its data, detached
  int64_t begin = 0;
  std::vector<ParameterBlock> blocks;
};

std::vector<Piece> pieces_of(const fsdp::FullyShardedModule& sharded) {
  const auto root = sharded.module();
  TORCH_CHECK(root != nullptr, "[commgrad] checkpoint: the sharded module no longer exists");
  const auto params = root->named_parameters();
  std::vector<Piece> out;
  for (const auto& unit : sharded.units()) {
    for (const auto& s : unit.segments) {
      Piece p;
      p.name = unit.module.empty() ? s.name : unit.module + "." + s.name;
      p.param = params[p.name];
      p.tensor = p.param.detach();
      p.begin = s.param_begin;
      p.blocks = parameter_blocks(*root, p.name, at::empty(s.sizes, at::TensorOptions().device(at::kMeta)));
      out.push_back(std::move(p));
    }
  }
  return out;
}

std::string state_name(const std::string& prefix, const std::string& state, const std::string& param) {
  return prefix + state + "/" + param;
}

void append(std::vector<TensorPiece>& to, std::vector<TensorPiece> more) {
  to.insert(to.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
}

}  // namespace

std::vector<TensorPiece> fsdp_pieces(const fsdp::FullyShardedModule& sharded, const std::string& prefix) {
  std::vector<TensorPiece> pieces;
  for (const auto& p : pieces_of(sharded)) append(pieces, range_pieces(p.blocks, prefix + p.name, p.begin, p.tensor));
  for (const auto& b : sharded.module()->named_buffers()) pieces.push_back(TensorPiece::whole(prefix + b.key(), b.value()));
  return pieces;
}

std::vector<TensorPiece> fsdp_optimizer_pieces(const fsdp::FullyShardedModule& sharded,
                                               torch::optim::Optimizer& optimizer, const std::string& prefix) {
  std::vector<TensorPiece> pieces;
  int64_t step = 0;
  for (const auto& p : pieces_of(sharded)) {
    const auto state = optim::get_param_state(optimizer, p.param);
    if (!state) continue;
    if (state->step) step = *state->step;
    for (const auto& [name, tensor] : state->tensors) {
      if (!tensor.defined()) continue;
      append(pieces, range_pieces(p.blocks, state_name(prefix, name, p.name), p.begin, tensor.detach().reshape({-1})));
    }
  }
  pieces.push_back(TensorPiece::whole(prefix + "step", at::full({1}, step, at::kLong)));
  return pieces;
}

std::vector<TensorPiece> fsdp_optimizer_load_pieces(const fsdp::FullyShardedModule& sharded,
                                                    torch::optim::Optimizer& optimizer, const std::string& prefix) {
  const auto names = optim::param_state_names(optimizer);
  std::vector<TensorPiece> pieces;
  for (const auto& p : pieces_of(sharded)) {
    for (const auto& state : names) {
      auto data = at::zeros({p.tensor.numel()}, p.tensor.options());
      append(pieces, range_pieces(p.blocks, state_name(prefix, state, p.name), p.begin, data, /*required=*/false));
    }
  }
  auto step = TensorPiece::whole(prefix + "step", at::zeros({1}, at::kLong));
  step.required = false;  // a weights-only checkpoint: restore_fsdp_optimizer() says so
  pieces.push_back(std::move(step));
  return pieces;
}

void restore_fsdp_optimizer(const fsdp::FullyShardedModule& sharded, torch::optim::Optimizer& optimizer,
                            const std::vector<TensorPiece>& pieces, const LoadResult& result,
                            const std::string& prefix) {
  const std::set<std::string> skipped(result.skipped.begin(), result.skipped.end());
  TORCH_CHECK(!pieces.empty() && pieces.back().name == prefix + "step", "[commgrad] restore_fsdp_optimizer: no '",
              prefix, "step' piece (use fsdp_optimizer_load_pieces())");
  TORCH_CHECK(!skipped.count(prefix + "step"), "[commgrad] restore_fsdp_optimizer: the checkpoint in ",
              result.directory, " holds no optimizer state under '", prefix, "'");
  const int64_t step = pieces.back().tensor.item<int64_t>();
  const auto names = optim::param_state_names(optimizer);
  std::map<std::string, std::pair<int, int>> found;  // state -> (loaded, skipped) parameters
  size_t next = 0;
  for (const auto& p : pieces_of(sharded)) {
    optim::ParamState state;
    state.step = step;
    for (const auto& name : names) {
      // In fsdp_optimizer_load_pieces()'s order: the run of this name is this piece's.
      const auto key = state_name(prefix, name, p.name);
      TORCH_CHECK(next < pieces.size() && pieces[next].name == key, "[commgrad] restore_fsdp_optimizer: the pieces "
                  "are not those fsdp_optimizer_load_pieces() made for this optimizer (expected '", key, "')");
      std::vector<at::Tensor> parts;
      for (; next < pieces.size() && pieces[next].name == key; ++next) parts.push_back(pieces[next].tensor.reshape({-1}));
      if (skipped.count(key)) {
        ++found[name].second;
        continue;
      }
      ++found[name].first;
      state.tensors.emplace_back(name, parts.size() == 1 ? parts[0] : at::cat(parts));
    }
    optim::set_param_state(optimizer, p.param, state);
  }
  for (const auto& [name, counts] : found) {
    TORCH_CHECK(counts.first == 0 || counts.second == 0, "[commgrad] restore_fsdp_optimizer: the checkpoint in ",
                result.directory, " holds state '", name, "' for only some of the parameters (", counts.second,
                " of this rank's pieces missing)");
  }
}

}  // namespace commgrad::checkpoint
