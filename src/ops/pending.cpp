// raw::Pending: waiting for a raw call's transport work and finishing it.
//
// A failed or timed-out step becomes one error that names the op, the group
// and the collective's number in its group (the only counter a user sees),
// says the group cannot be used any more (a transport that failed half way
// has lost its place in the stream), and is raised again on every later
// wait(); docs/errors.md lists the classes of failure.

#include "detail/pending.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/flight_recorder.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/error.h"
#include "commgrad/util/print.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <vector>

namespace commgrad::ops {
namespace detail {
namespace {

// " (10.0.0.2 is ranks [2, 3] of this group)" for each "[address]" in a
// transport's message (Gloo names the peer it lost by address) that belongs
// to some but not all members; "" otherwise.
std::string ranks_behind_addresses(const std::string& message, const Group& group) {
  const auto& addresses = group.state()->addresses;
  std::string out;
  std::vector<std::string> named;
  for (auto open = message.find('['); open != std::string::npos; open = message.find('[', open + 1)) {
    const auto close = message.find(']', open);
    if (close == std::string::npos) break;
    const std::string address = message.substr(open + 1, close - open - 1);
    if (address.empty() || std::find(named.begin(), named.end(), address) != named.end()) continue;
    std::vector<int> ranks;
    for (int r = 0; r < static_cast<int>(addresses.size()); ++r) {
      if (addresses[r] == address) ranks.push_back(r);
    }
    if (ranks.empty() || ranks.size() == addresses.size()) continue;
    named.push_back(address);
    out += c10::str(" (", address, " is ", ranks.size() == 1 ? "rank " : "ranks ",
                    ranks.size() == 1 ? std::to_string(ranks[0]) : format_ranks(ranks), " of this group)");
  }
  return out;
}

}  // namespace

PendingState::~PendingState() {
  if (!done && !error && group.defined()) commgrad::detail::note_collective_finished(record);
}

std::string message_of(const std::exception& e) {
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) return c10e->what_without_backtrace();
  return e.what();
}

void wait_step(const char* op, const Group& group, uint64_t sequence, uint64_t record,
               const commgrad::detail::WorkPtr& work, Clock::time_point posted) {
  try {
    commgrad::detail::wait_work(work);
  } catch (const std::exception& e) {
    // commgrad's own transport says what kind of failure it was; for another
    // (Gloo names neither), a wait that lasted the group's timeout is one.
    const Error* typed = as_commgrad_error(e);
    const std::string transport_message = typed ? typed->detail() : message_of(e);
    const bool timeout = typed ? typed->kind() == ErrorKind::kTimeout : Clock::now() - posted >= group.timeout();
    commgrad::detail::note_collective_failed(
        record, timeout,
        c10::str(timeout ? "timeout" : "failure", ": ", op, " #", sequence, " on group '", group.name(), "'"));
    COMMGRAD_THROW(
        timeout ? ErrorKind::kTimeout : ErrorKind::kPeerFailed, error_site(op, group, static_cast<int64_t>(sequence)),
        "collective #", sequence,
        timeout ? c10::str(" did not complete within the group timeout (", group.timeout().count() / 1000.0, "s)")
                : std::string(" failed"),
        ": ", transport_message, ranks_behind_addresses(transport_message, group),
        " -- a peer may have failed, be late, or have called a different collective (set COMMGRAD_DEBUG=1 on "
        "every rank to check each collective across ranks); this group cannot be used any more");
  }
}

}  // namespace detail

namespace raw {

bool Pending::is_completed() const {
  TORCH_CHECK(state_, "[commgrad] is_completed() on an empty Pending");
  if (state_->done) return true;
  for (const auto& w : state_->works) {
    if (!w->isCompleted()) return false;
  }
  return true;
}

at::Tensor Pending::wait() {
  TORCH_CHECK(state_, "[commgrad] wait() on an empty Pending");
  auto& s = *state_;
  if (s.error) std::rethrow_exception(s.error);  // a failed wait fails again, with its type
  if (s.done) return s.result;
  try {
    for (auto& w : s.works) detail::wait_step(s.op, s.group, s.sequence, s.record, w, s.posted);
    s.works.clear();
    if (s.finish) {
      auto finish = std::move(s.finish);
      s.finish = nullptr;
      s.result = finish();
    }
  } catch (...) {
    s.error = std::current_exception();
    s.works.clear();
    s.finish = nullptr;
    throw;
  }
  s.done = true;
  commgrad::detail::note_collective_finished(s.record);
  return s.result;
}

}  // namespace raw
}  // namespace commgrad::ops
