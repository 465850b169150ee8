// A fully_shard model and its optimizer as checkpoint pieces (see the header).

#include "commgrad/checkpoint/fsdp_state.h"

#include "detail/state_runs.h"

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

using detail::state_name;

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

void append(std::vector<TensorPiece>& to, std::vector<TensorPiece> more) {
  to.insert(to.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
}

}  // namespace

std::vector<TensorPiece> fsdp_pieces(const fsdp::FullyShardedModule& sharded, const std::string& prefix) {
  std::vector<TensorPiece> pieces;
  for (const auto& p : pieces_of(sharded)) append(pieces, range_pieces(p.blocks, prefix + p.name, p.begin, p.tensor));
  for (const auto& b : sharded.module()->named_buffers())
    pieces.push_back(TensorPiece::whole(prefix + b.key(), b.value()));
  return pieces;
}

std::vector<TensorPiece> fsdp_gradient_pieces(const fsdp::FullyShardedModule& sharded, const std::string& prefix) {
  std::vector<TensorPiece> pieces;
  for (const auto& p : pieces_of(sharded)) {
    const at::Tensor& grad = p.param.grad();
    if (grad.defined()) append(pieces, range_pieces(p.blocks, prefix + p.name, p.begin, grad.detach()));
  }
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
  detail::StateRuns runs(pieces, result, "restore_fsdp_optimizer", "fsdp_optimizer_load_pieces()");
  const int64_t step = runs.step(prefix, pieces.empty() ? 0 : pieces.size() - 1);
  const auto names = optim::param_state_names(optimizer);
  for (const auto& p : pieces_of(sharded)) {
    optim::ParamState state;
    state.step = step;
    for (const auto& name : names) {
      if (auto value = runs.take(prefix, name, p.name)) state.tensors.emplace_back(name, *value);
    }
    optim::set_param_state(optimizer, p.param, state);
  }
  runs.check_complete("pieces");
}

}  // namespace commgrad::checkpoint
