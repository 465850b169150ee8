#pragma once
// What the schedules and their simulator share about actions (internal to
// commgrad_pp).

#include "commgrad/pp/schedule.h"

#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace commgrad::pp::detail {

/// A schedule that cannot be built or run: std::invalid_argument naming it.
[[noreturn]] inline void fail(const std::string& message) { throw std::invalid_argument("[commgrad] pp: " + message); }

/// The operation a communication action matches on the peer's rank, and that rank.
inline std::pair<Action, int> counterpart(const Schedule& s, const Action& a) {
  using Kind = ActionKind;
  switch (a.kind) {
    case Kind::kSendActivation:
      return {{Kind::kRecvActivation, a.stage + 1, a.microbatch}, s.rank_of(a.stage + 1)};
    case Kind::kRecvActivation:
      return {{Kind::kSendActivation, a.stage - 1, a.microbatch}, s.rank_of(a.stage - 1)};
    case Kind::kSendGradient:
      return {{Kind::kRecvGradient, a.stage - 1, a.microbatch}, s.rank_of(a.stage - 1)};
    case Kind::kRecvGradient:
      return {{Kind::kSendGradient, a.stage + 1, a.microbatch}, s.rank_of(a.stage + 1)};
    default:
      break;
  }
  return {a, -1};
}

/// An action without its batching: kind, stage, microbatch.
using ActionKey = std::tuple<int, int, int>;
inline ActionKey key_of(ActionKind kind, int stage, int microbatch) {
  return {static_cast<int>(kind), stage, microbatch};
}
inline ActionKey key_of(const Action& a) { return key_of(a.kind, a.stage, a.microbatch); }

}  // namespace commgrad::pp::detail
