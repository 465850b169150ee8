// Pipeline schedules (the simulator that checks them: simulator.cpp).
//
// Generation. Each schedule is first written as every rank's order of
// computations (F and B of a stage and microbatch); the communication is
// then derived from it in one way for all schedules: between two
// computations a rank posts, as one batch, the sends of what the first one
// produced (its output to the next stage's rank, or its input gradient to
// the previous stage's rank) and the receive the second one needs. Posting
// a send together with the next receive is what makes 1F1B's steady state
// safe on a transport whose sends complete only when received (Megatron's
// send_forward_recv_backward); the simulator checks every generated
// schedule under exactly that rule.
//
#include "commgrad/pp/schedule.h"

#include "detail/actions.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace commgrad::pp {
namespace {

using detail::fail;
using Kind = ActionKind;

void check_sizes(const char* name, int ranks, int microbatches, int stages_per_rank) {
  if (ranks < 1) fail(std::string(name) + ": ranks must be at least 1, got " + std::to_string(ranks));
  if (stages_per_rank < 1) {
    fail(std::string(name) + ": stages per rank must be at least 1, got " + std::to_string(stages_per_rank));
  }
  if (microbatches < ranks) {
    fail(std::string(name) + ": " + std::to_string(microbatches) + " microbatches for " + std::to_string(ranks) +
         " pipeline ranks; a pipeline needs at least one microbatch per rank");
  }
}

struct Compute {
  Kind kind;
  int stage;
  int microbatch;
};

// A group of computations run back to back: the communication around it is
// one batch before it (its receives, with the previous slot's sends).
using Slot = std::vector<Compute>;

// Adds the communication to every rank's slots (see the file comment).
Schedule with_communication(Schedule s, const std::vector<std::vector<Slot>>& slots) {
  const int last = s.stages() - 1;
  s.actions.assign(s.ranks, {});
  for (int r = 0; r < s.ranks; ++r) {
    auto& out = s.actions[r];
    auto post = [&](std::vector<Action> batch) {
      for (size_t i = 0; i < batch.size(); ++i) {
        batch[i].batched_with_next = i + 1 < batch.size();
        out.push_back(batch[i]);
      }
    };
    std::vector<Action> pending;  // sends of the previous slot
    for (const auto& slot : slots[r]) {
      for (const auto& c : slot) {
        if (c.kind == Kind::kForward && c.stage > 0 && s.rank_of(c.stage - 1) != r) {
          pending.push_back({Kind::kRecvActivation, c.stage, c.microbatch});
        }
        if (c.kind == Kind::kBackward && c.stage < last && s.rank_of(c.stage + 1) != r) {
          pending.push_back({Kind::kRecvGradient, c.stage, c.microbatch});
        }
      }
      post(pending);
      pending.clear();
      for (const auto& c : slot) {
        out.push_back({c.kind, c.stage, c.microbatch});
        if (c.kind == Kind::kForward && c.stage < last && s.rank_of(c.stage + 1) != r) {
          pending.push_back({Kind::kSendActivation, c.stage, c.microbatch});
        }
        if (c.kind == Kind::kBackward && c.stage > 0 && s.rank_of(c.stage - 1) != r) {
          pending.push_back({Kind::kSendGradient, c.stage, c.microbatch});
        }
      }
    }
    post(pending);
  }
  return s;
}

// One slot per computation.
std::vector<std::vector<Slot>> single_slots(const std::vector<std::vector<Compute>>& order) {
  std::vector<std::vector<Slot>> slots(order.size());
  for (size_t r = 0; r < order.size(); ++r) {
    for (const auto& c : order[r]) slots[r].push_back({c});
  }
  return slots;
}

Schedule blank(const std::string& name, int ranks, int microbatches, int stages_per_rank) {
  Schedule s;
  s.name = name;
  s.ranks = ranks;
  s.microbatches = microbatches;
  s.stages_per_rank = stages_per_rank;
  return s;
}

}  // namespace

std::string Action::to_string() const {
  static const char* names[] = {"F", "B", "sendA", "recvA", "sendG", "recvG", "W"};
  return names[static_cast<int>(kind)] + std::to_string(stage) + "." + std::to_string(microbatch);
}

std::ostream& operator<<(std::ostream& out, const Action& action) { return out << action.to_string(); }

bool Schedule::splits_backward() const {
  for (const auto& list : actions) {
    for (const auto& a : list) {
      if (a.kind == Kind::kBackwardWeight) return true;
    }
  }
  return false;
}

std::string Schedule::describe() const {
  std::ostringstream out;
  for (int r = 0; r < ranks; ++r) {
    out << "rank " << r << ":";
    for (size_t i = 0; i < actions[r].size(); ++i) {
      const auto& a = actions[r][i];
      const bool opens = a.batched_with_next && (i == 0 || !actions[r][i - 1].batched_with_next);
      const bool closes = !a.batched_with_next && i > 0 && actions[r][i - 1].batched_with_next;
      out << " " << (opens ? "[" : "") << a.to_string() << (closes ? "]" : "");
    }
    out << "\n";
  }
  return out.str();
}

Schedule gpipe(int ranks, int microbatches) {
  check_sizes("gpipe", ranks, microbatches, 1);
  auto s = blank("gpipe", ranks, microbatches, 1);
  std::vector<std::vector<Compute>> order(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (int mb = 0; mb < microbatches; ++mb) order[r].push_back({Kind::kForward, r, mb});
    for (int mb = 0; mb < microbatches; ++mb) order[r].push_back({Kind::kBackward, r, mb});
  }
  return with_communication(s, single_slots(order));
}

Schedule one_f_one_b(int ranks, int microbatches) {
  check_sizes("1f1b", ranks, microbatches, 1);
  auto s = blank("1f1b", ranks, microbatches, 1);
  std::vector<std::vector<Compute>> order(ranks);
  for (int r = 0; r < ranks; ++r) {
    const int warmup = std::min(ranks - r - 1, microbatches);
    for (int mb = 0; mb < warmup; ++mb) order[r].push_back({Kind::kForward, r, mb});
    for (int i = 0; i < microbatches - warmup; ++i) {
      order[r].push_back({Kind::kForward, r, warmup + i});
      order[r].push_back({Kind::kBackward, r, i});
    }
    for (int mb = microbatches - warmup; mb < microbatches; ++mb) order[r].push_back({Kind::kBackward, r, mb});
  }
  return with_communication(s, single_slots(order));
}

Schedule interleaved_one_f_one_b(int ranks, int microbatches, int stages_per_rank) {
  check_sizes("interleaved", ranks, microbatches, stages_per_rank);
  if (microbatches % ranks != 0) {
    fail("interleaved: " + std::to_string(microbatches) + " microbatches do not split into groups of " +
         std::to_string(ranks) + " (one per pipeline rank), which the interleaved schedule needs");
  }
  const int p = ranks, v = stages_per_rank;
  auto s = blank("interleaved", ranks, microbatches, stages_per_rank);
  const int total = microbatches * v;  // computations of each kind on a rank
  // The k-th forward (backward) of a rank: groups of p microbatches go through
  // the rank's stages in turn (backward in reverse stage order).
  auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto forward_chunk = [&](int k) { return (k / p) % v; };
  auto backward_chunk = [&](int k) { return v - 1 - (k / p) % v; };
  // The steady state runs a forward and a backward per slot, so that one
  // batch carries both sends and both next receives (Megatron's
  // send_forward_backward_recv_forward_backward).
  std::vector<std::vector<Slot>> slots(ranks);
  for (int r = 0; r < ranks; ++r) {
    auto forward = [&](int k) { return Compute{Kind::kForward, forward_chunk(k) * p + r, microbatch(k)}; };
    auto backward = [&](int k) { return Compute{Kind::kBackward, backward_chunk(k) * p + r, microbatch(k)}; };
    const int warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    for (int k = 0; k < warmup; ++k) slots[r].push_back({forward(k)});
    for (int i = 0; i < total - warmup; ++i) slots[r].push_back({forward(warmup + i), backward(i)});
    for (int k = total - warmup; k < total; ++k) slots[r].push_back({backward(k)});
  }
  return with_communication(s, slots);
}

Schedule zero_bubble_h1(int ranks, int microbatches) {
  check_sizes("zbh1", ranks, microbatches, 1);
  auto s = blank("zbh1", ranks, microbatches, 1);
  const int p = ranks, m = microbatches;
  // List scheduling in unit time steps (every computation costs 1, there
  // is no transfer time): at each step every free rank takes B if its
  // output gradient is there, else F if its input is there and the memory
  // bounds allow, else the oldest W waiting.
  constexpr int kNever = std::numeric_limits<int>::max();
  std::vector<std::vector<int>> input_at(p, std::vector<int>(m, kNever));  // activation (rank 0: the batch)
  std::vector<std::vector<int>> gradient_at(p, std::vector<int>(m, kNever));
  std::vector<std::vector<int>> forward_done(p, std::vector<int>(m, kNever));
  std::fill(input_at[0].begin(), input_at[0].end(), 0);
  std::vector<int> forwards(p, 0), backwards(p, 0), weights(p, 0);
  std::vector<std::vector<Compute>> order(p);
  for (int t = 0; std::any_of(weights.begin(), weights.end(), [&](int w) { return w < m; }); ++t) {
    if (t > 4 * (m + p)) {
      fail("zbh1: no order found for " + std::to_string(p) + " ranks and " + std::to_string(m) + " microbatches");
    }
    for (int r = 0; r < p; ++r) {
      const int f = forwards[r], b = backwards[r];
      if (b < m && forward_done[r][b] <= t && (r == p - 1 || gradient_at[r][b] <= t)) {
        order[r].push_back({Kind::kBackward, r, b});
        if (r > 0) gradient_at[r - 1][b] = t + 1;
        ++backwards[r];
      } else if (f < m && input_at[r][f] <= t && f - b < p - r && f - weights[r] < 2 * p - r - 1) {
        order[r].push_back({Kind::kForward, r, f});
        forward_done[r][f] = t + 1;
        if (r < p - 1) input_at[r + 1][f] = t + 1;
        ++forwards[r];
      } else if (weights[r] < b) {
        order[r].push_back({Kind::kBackwardWeight, r, weights[r]++});
      }  // else idle this step
    }
  }
  return with_communication(s, single_slots(order));
}

Schedule make_schedule(const std::string& name, int ranks, int microbatches, int stages_per_rank) {
  if (name == "gpipe" || name == "1f1b" || name == "zbh1") {
    if (stages_per_rank != 1)
      fail(name + " runs one stage per rank; use \"interleaved\" for " + std::to_string(stages_per_rank));
    if (name == "zbh1") return zero_bubble_h1(ranks, microbatches);
    return name == "gpipe" ? gpipe(ranks, microbatches) : one_f_one_b(ranks, microbatches);
  }
  if (name == "interleaved") return interleaved_one_f_one_b(ranks, microbatches, stages_per_rank);
  fail("unknown schedule \"" + name + "\" (gpipe, 1f1b, interleaved, zbh1)");
}

}  // namespace commgrad::pp
