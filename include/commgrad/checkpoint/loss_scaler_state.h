#pragma once
// A DynamicLossScaler's state in a checkpoint.
//
// The state is replicated: every rank holds the same scale, trackers and
// skip count (the ranks agree on every inf/NaN step). Each entry of
// DynamicLossScaler::state_dict() becomes one whole-tensor piece named
// prefix + key ("scaler/scale", "scaler/growth_tracker",
// "scaler/hysteresis_tracker", "scaler/skipped_steps"); every rank passes
// the same pieces and save() writes them once (by the lowest rank). At load
// every rank reads them back, under any layout or world size.

#include "commgrad/checkpoint/load.h"
#include "commgrad/checkpoint/tensor_piece.h"

#include <string>
#include <vector>

namespace commgrad::optim {
class DynamicLossScaler;
}  // namespace commgrad::optim

namespace commgrad::checkpoint {

/// The pieces of `scaler`'s state (copies): for save() as they are; for
/// load(), pass the same list and then call restore_loss_scaler().
///
/// Example:
///   auto pieces = checkpoint::module_pieces(*model);
///   auto scaler_state = checkpoint::loss_scaler_pieces(scaler);
///   pieces.insert(pieces.end(), scaler_state.begin(), scaler_state.end());
///   checkpoint::save("ckpt", step, pieces);
///   ...
///   auto scaler_state = checkpoint::loss_scaler_pieces(scaler);
///   auto result = checkpoint::load("ckpt", scaler_state);
///   checkpoint::restore_loss_scaler(scaler, scaler_state, result);
std::vector<TensorPiece> loss_scaler_pieces(const optim::DynamicLossScaler& scaler,
                                            const std::string& prefix = "scaler/");

/// Loads into `scaler` the state load() wrote into `pieces` (from
/// loss_scaler_pieces() with the same prefix). Errors when the checkpoint
/// lacked some of it (a piece in result.skipped) or the pieces are not
/// loss_scaler_pieces()'.
void restore_loss_scaler(optim::DynamicLossScaler& scaler, const std::vector<TensorPiece>& pieces,
                         const LoadResult& result, const std::string& prefix = "scaler/");

}  // namespace commgrad::checkpoint
