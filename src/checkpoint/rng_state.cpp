// RNG tracker states as checkpoint pieces (rule in rng_state.h).
//
// A generator's state is a uint8 tensor (get_state()); each becomes one
// whole-tensor piece. Names carry the stream and, except for the default
// stream, the TP rank, so a load at another TP size finds (or, as an
// optional piece, skips) the stream of each TP rank.

#include "commgrad/checkpoint/rng_state.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

namespace commgrad::checkpoint {

std::vector<TensorPiece> rng_pieces(const tp::RngTracker& tracker, const Group& tp_group, const std::string& prefix) {
  TORCH_CHECK(tp_group.defined() && tp_group.is_member(),
              "[commgrad] checkpoint::rng_pieces: needs the tensor-parallel group this rank belongs to");
  std::vector<TensorPiece> pieces;
  for (const auto& [stream, state] : tracker.get_states()) {
    if (stream == tp::kDefaultRng) {
      pieces.push_back(TensorPiece::whole(prefix + tp::kDefaultRng, state.clone()));
    } else {
      auto piece = TensorPiece::whole(c10::str(prefix, stream, "/tp", tp_group.rank()), state.clone());
      piece.required = false;
      pieces.push_back(std::move(piece));
    }
  }
  return pieces;
}

std::vector<std::string> restore_rng(tp::RngTracker tracker, const std::vector<TensorPiece>& pieces,
                                     const LoadResult& result, const std::string& prefix) {
  tp::RngStates states;
  for (const auto& piece : pieces) {
    if (piece.name.rfind(prefix, 0) != 0) continue;
    if (std::find(result.skipped.begin(), result.skipped.end(), piece.name) != result.skipped.end()) continue;
    std::string stream = piece.name.substr(prefix.size());
    const auto tp = stream.rfind("/tp");
    if (stream != tp::kDefaultRng) {
      TORCH_CHECK(tp != std::string::npos, "[commgrad] checkpoint::restore_rng: '", piece.name,
                  "' is not a piece rng_pieces() makes");
      stream = stream.substr(0, tp);
    }
    states[stream] = piece.tensor;
  }
  tracker.set_states(states);
  std::vector<std::string> restored;
  for (const auto& item : states) restored.push_back(item.first);
  return restored;
}

}  // namespace commgrad::checkpoint
