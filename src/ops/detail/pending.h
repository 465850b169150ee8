#pragma once
// What a raw::Pending refers to (internal to commgrad_ops).

#include "commgrad/detail/torch_compat.h"
#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace commgrad::ops::detail {

using Clock = std::chrono::steady_clock;

/// The transport's work handles of one raw call and the local step that
/// turns their buffers into the result.
struct PendingState {
  /// A call dropped without a wait counts as finished for the terminate
  /// handler (nobody waits on it any more); a failed one does not.
  ~PendingState();
  const char* op = "";
  Group group;
  uint64_t sequence = 0;
  uint64_t record = ~uint64_t{0};  // the flight recorder's number of the call (none: not recorded)
  std::vector<commgrad::detail::WorkPtr> works;
  std::function<at::Tensor()> finish;  // runs once, after every work finished (may wait on more)
  at::Tensor result;                   // set by finish (or directly)
  bool done = false;
  std::exception_ptr error;  // set when a work failed
  Clock::time_point posted = Clock::now();
};

/// An exception's message without LibTorch's C++ backtrace.
std::string message_of(const std::exception& e);

/// Waits for `work`, one step of collective #`sequence` (`op` on `group`);
/// a failure throws the same error as raw::Pending::wait().
/// `posted` is when the work was started (a transport that does not say a
/// failure was a timeout timed out when the wait lasted the group's timeout).
/// `record` is the call's flight-recorder number (marked failed, then dumped).
void wait_step(const char* op, const Group& group, uint64_t sequence, uint64_t record,
               const commgrad::detail::WorkPtr& work, Clock::time_point posted);

}  // namespace commgrad::ops::detail
