// DynamicLossScaler state as checkpoint pieces (rule in loss_scaler_state.h).
//
// Each state_dict() entry is a 0-d tensor and becomes one whole-tensor
// piece. The pieces are identical on every rank, so save() writes each once.

#include "commgrad/checkpoint/loss_scaler_state.h"

#include "commgrad/optim/loss_scaler.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace commgrad::checkpoint {

std::vector<TensorPiece> loss_scaler_pieces(const optim::DynamicLossScaler& scaler, const std::string& prefix) {
  std::vector<TensorPiece> pieces;
  for (const auto& item : scaler.state_dict()) {
    pieces.push_back(TensorPiece::whole(prefix + item.key(), item.value()));
  }
  return pieces;
}

void restore_loss_scaler(optim::DynamicLossScaler& scaler, const std::vector<TensorPiece>& pieces,
                         const LoadResult& result, const std::string& prefix) {
  torch::OrderedDict<std::string, at::Tensor> state;
  for (const auto& piece : pieces) {
    if (piece.name.rfind(prefix, 0) != 0) continue;
    TORCH_CHECK(std::find(result.skipped.begin(), result.skipped.end(), piece.name) == result.skipped.end(),
                "[commgrad] checkpoint::restore_loss_scaler: the checkpoint of step ", result.step, " has no '",
                piece.name, "'");
    state.insert(piece.name.substr(prefix.size()), piece.tensor);
  }
  scaler.load_state_dict(state);  // names any entry the pieces lacked
}

}  // namespace commgrad::checkpoint
