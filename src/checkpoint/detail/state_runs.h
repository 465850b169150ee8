#pragma once
// Reading optimizer state back from the pieces that optimizer_load_pieces()
// or fsdp_optimizer_load_pieces() made (internal to commgrad_checkpoint):
// both list, for each parameter (or range of one) and each state, one run of
// pieces named "<prefix><state>/<parameter>", in the order restore walks.

#include "commgrad/checkpoint/load.h"
#include "commgrad/checkpoint/tensor_piece.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace commgrad::checkpoint::detail {

/// "<prefix><state>/<parameter>": the name a state of a parameter is saved under.
inline std::string state_name(const std::string& prefix, const std::string& state, const std::string& param) {
  return prefix + state + "/" + param;
}

/// Walks the runs of pieces in order.
class StateRuns {
 public:
  /// `op` names the restore in errors, `maker` the function that made the pieces.
  StateRuns(const std::vector<TensorPiece>& pieces, const LoadResult& result, std::string op, std::string maker)
      : pieces_(pieces),
        result_(result),
        skipped_(result.skipped.begin(), result.skipped.end()),
        op_(std::move(op)),
        maker_(std::move(maker)) {}

  /// The next run, which must be named state_name(prefix, state, param),
  /// as one flat tensor; nullopt when the checkpoint did not hold it.
  std::optional<at::Tensor> take(const std::string& prefix, const std::string& state, const std::string& param) {
    const auto key = state_name(prefix, state, param);
    TORCH_CHECK(next_ < pieces_.size() && pieces_[next_].name == key, "[commgrad] ", op_, ": the pieces are not those ",
                maker_, " made for this optimizer (expected '", key, "')");
    std::vector<at::Tensor> parts;
    for (; next_ < pieces_.size() && pieces_[next_].name == key; ++next_)
      parts.push_back(pieces_[next_].tensor.reshape({-1}));
    auto& [loaded, missing] = counts_[state];
    if (skipped_.count(key)) {
      ++missing;
      return std::nullopt;
    }
    ++loaded;
    return parts.size() == 1 ? parts[0] : at::cat(parts);
  }

  /// The saved step: the piece "<prefix>step" at `index` (the end of the runs).
  int64_t step(const std::string& prefix, size_t index) const {
    TORCH_CHECK(index < pieces_.size() && pieces_[index].name == prefix + "step", "[commgrad] ", op_, ": no '", prefix,
                "step' piece (use ", maker_, ")");
    TORCH_CHECK(!skipped_.count(prefix + "step"), "[commgrad] ", op_, ": the checkpoint in ", result_.directory,
                " holds no optimizer state under '", prefix, "'");
    return pieces_[index].tensor.item<int64_t>();
  }

  /// Errors when a state was held for some of this rank's `what` and not others.
  void check_complete(const char* what) const {
    for (const auto& [state, count] : counts_) {
      TORCH_CHECK(count.first == 0 || count.second == 0, "[commgrad] ", op_, ": the checkpoint in ", result_.directory,
                  " holds state '", state, "' for only some of the parameters (", count.second, " of this rank's ",
                  what, " missing)");
    }
  }

  size_t position() const { return next_; }

 private:
  const std::vector<TensorPiece>& pieces_;
  const LoadResult& result_;
  const std::set<std::string> skipped_;
  const std::string op_, maker_;
  std::map<std::string, std::pair<int, int>> counts_;  // state -> (loaded, missing) runs
  size_t next_ = 0;
};

}  // namespace commgrad::checkpoint::detail
