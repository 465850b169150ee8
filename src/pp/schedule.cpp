// Pipeline schedules and their simulator.
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
// Simulation. Every rank walks its list with its own clock. A computation
// takes its cost; a batch is posted at the rank's clock and each of its
// operations completes when the peer has posted the matching one, at the
// later of the two posting times (no transfer time: the bubble is a
// property of the order); with buffered sends (the default) a send is done
// when posted and its receive completes at the later of the two posting
// times. The rank moves on when its whole batch is done.
// When no rank can move and some have not finished, the schedule deadlocks.

#include "commgrad/pp/schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace commgrad::pp {
namespace {

using Kind = ActionKind;

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument("[commgrad] pp: " + message); }

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

// The operation a communication action matches on the peer's rank, and that rank.
std::pair<Action, int> counterpart(const Schedule& s, const Action& a) {
  switch (a.kind) {
    case Kind::kSendActivation: return {{Kind::kRecvActivation, a.stage + 1, a.microbatch}, s.rank_of(a.stage + 1)};
    case Kind::kRecvActivation: return {{Kind::kSendActivation, a.stage - 1, a.microbatch}, s.rank_of(a.stage - 1)};
    case Kind::kSendGradient: return {{Kind::kRecvGradient, a.stage - 1, a.microbatch}, s.rank_of(a.stage - 1)};
    case Kind::kRecvGradient: return {{Kind::kSendGradient, a.stage + 1, a.microbatch}, s.rank_of(a.stage + 1)};
    default: break;
  }
  return {a, -1};
}

using Key = std::tuple<int, int, int>;  // kind, stage, microbatch
Key key_of(Kind kind, int stage, int microbatch) { return {static_cast<int>(kind), stage, microbatch}; }

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
    if (stages_per_rank != 1) fail(name + " runs one stage per rank; use \"interleaved\" for " +
                                   std::to_string(stages_per_rank));
    if (name == "zbh1") return zero_bubble_h1(ranks, microbatches);
    return name == "gpipe" ? gpipe(ranks, microbatches) : one_f_one_b(ranks, microbatches);
  }
  if (name == "interleaved") return interleaved_one_f_one_b(ranks, microbatches, stages_per_rank);
  fail("unknown schedule \"" + name + "\" (gpipe, 1f1b, interleaved, zbh1)");
}

SimulationResult simulate(const Schedule& s, const SimulationOptions& options) {
  if (static_cast<int>(s.actions.size()) != s.ranks) {
    fail("simulate " + s.name + ": " + std::to_string(s.actions.size()) + " action lists for " +
         std::to_string(s.ranks) + " ranks");
  }
  struct Rank {
    size_t pc = 0;       // next action
    double clock = 0;
    double busy = 0;
    bool posted = false;  // the batch at pc is posted
    double posted_at = 0;
    size_t batch_end = 0;  // one past the batch's last action
    std::vector<char> done;  // per action of the batch
    std::set<Key> have;      // computed or received here
    int in_flight = 0;
    int awaiting_weight = 0;
  };
  std::vector<Rank> ranks(s.ranks);
  SimulationResult result;
  const bool split = s.splits_backward();
  if (split && (options.backward_weight() < 0 || options.backward_weight() > options.backward())) {
    fail("simulate " + s.name + ": backward_weight (" + std::to_string(options.backward_weight()) +
         ") must lie between 0 and backward (" + std::to_string(options.backward()) + ")");
  }
  const int last = s.stages() - 1;
  std::map<Key, int> computed;  // F and B per (stage, microbatch)
  std::map<Key, double> mailbox;  // buffered sends, by the receive they match: posting time

  auto where = [&](int r, size_t i) {
    return "rank " + std::to_string(r) + " action " + std::to_string(i) + " (" + s.actions[r][i].to_string() + ")";
  };
  auto need = [&](int r, size_t i, Kind kind, int stage, int mb, const char* what) {
    if (!ranks[r].have.count(key_of(kind, stage, mb))) fail("simulate " + s.name + ": " + where(r, i) + " " + what);
  };
  // Checks a computation's inputs and runs it.
  auto compute = [&](int r) {
    auto& me = ranks[r];
    const size_t i = me.pc;
    const auto& a = s.actions[r][i];
    if (a.stage < 0 || a.stage > last || s.rank_of(a.stage) != r) {
      fail("simulate " + s.name + ": " + where(r, i) + " is not a stage of this rank");
    }
    if (a.microbatch < 0 || a.microbatch >= s.microbatches) fail("simulate " + s.name + ": " + where(r, i) + " has no such microbatch");
    if (a.kind == Kind::kForward) {
      if (a.stage > 0) {
        if (s.rank_of(a.stage - 1) == r) {
          need(r, i, Kind::kForward, a.stage - 1, a.microbatch, "runs before the forward of the previous stage");
        } else {
          need(r, i, Kind::kRecvActivation, a.stage, a.microbatch, "runs before its activation was received");
        }
      }
      me.busy += options.forward();
      me.clock += options.forward();
      result.peak_in_flight = std::max(result.peak_in_flight, ++me.in_flight);
    } else if (a.kind == Kind::kBackward) {
      need(r, i, Kind::kForward, a.stage, a.microbatch, "runs before the forward of the same microbatch");
      if (a.stage < last) {
        if (s.rank_of(a.stage + 1) == r) {
          need(r, i, Kind::kBackward, a.stage + 1, a.microbatch, "runs before the backward of the next stage");
        } else {
          need(r, i, Kind::kRecvGradient, a.stage, a.microbatch, "runs before its output gradient was received");
        }
      }
      const double cost = split ? options.backward() - options.backward_weight() : options.backward();
      me.busy += cost;
      me.clock += cost;
      --me.in_flight;
      if (split) result.peak_awaiting_weight = std::max(result.peak_awaiting_weight, ++me.awaiting_weight);
    } else {
      need(r, i, Kind::kBackward, a.stage, a.microbatch, "runs before the backward of the same microbatch");
      me.busy += options.backward_weight();
      me.clock += options.backward_weight();
      --me.awaiting_weight;
    }
    if (++computed[key_of(a.kind, a.stage, a.microbatch)] > 1) fail("simulate " + s.name + ": " + where(r, i) + " runs twice");
    me.have.insert(key_of(a.kind, a.stage, a.microbatch));
    ++me.pc;
  };
  // Posts the batch at pc (once) and checks what a send sends.
  auto post = [&](int r) {
    auto& me = ranks[r];
    if (me.posted) return;
    me.posted = true;
    me.posted_at = me.clock;
    me.batch_end = me.pc;
    while (me.batch_end < s.actions[r].size() && s.actions[r][me.batch_end].batched_with_next) ++me.batch_end;
    if (me.batch_end == s.actions[r].size()) fail("simulate " + s.name + ": rank " + std::to_string(r) + " ends inside a batch");
    ++me.batch_end;
    me.done.assign(me.batch_end - me.pc, 0);
    for (size_t i = me.pc; i < me.batch_end; ++i) {
      const auto& a = s.actions[r][i];
      if (a.is_compute()) fail("simulate " + s.name + ": " + where(r, i) + " is a computation inside a batch");
      const int peer_stage = counterpart(s, a).first.stage;
      if (a.stage < 0 || a.stage > last || s.rank_of(a.stage) != r || peer_stage < 0 || peer_stage > last ||
          s.rank_of(peer_stage) == r) {
        fail("simulate " + s.name + ": " + where(r, i) + " has no peer stage on another rank");
      }
      if (a.microbatch < 0 || a.microbatch >= s.microbatches) {
        fail("simulate " + s.name + ": " + where(r, i) + " has no such microbatch");
      }
      if (a.kind == Kind::kSendActivation) need(r, i, Kind::kForward, a.stage, a.microbatch, "sends an activation not computed yet");
      if (a.kind == Kind::kSendGradient) need(r, i, Kind::kBackward, a.stage, a.microbatch, "sends a gradient not computed yet");
      const bool send = a.kind == Kind::kSendActivation || a.kind == Kind::kSendGradient;
      if (send && !options.rendezvous_sends()) {
        const auto want = counterpart(s, a).first;
        if (!mailbox.emplace(key_of(want.kind, want.stage, want.microbatch), me.posted_at).second) {
          fail("simulate " + s.name + ": " + where(r, i) + " is sent twice");
        }
        me.done[i - me.pc] = 1;
      }
    }
  };
  auto finish_batch = [&](int r) {
    auto& me = ranks[r];
    if (std::find(me.done.begin(), me.done.end(), 0) != me.done.end()) return false;
    for (size_t i = me.pc; i < me.batch_end; ++i) {
      const auto& a = s.actions[r][i];
      me.have.insert(key_of(a.kind, a.stage, a.microbatch));
    }
    me.pc = me.batch_end;
    me.posted = false;
    return true;
  };

  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < s.ranks; ++r) {
      auto& me = ranks[r];
      while (me.pc < s.actions[r].size() && s.actions[r][me.pc].is_compute()) {
        compute(r);
        moved = true;
      }
      if (me.pc == s.actions[r].size()) continue;
      post(r);
      // Match this batch's operations with the peers' posted batches.
      for (size_t i = me.pc; i < me.batch_end; ++i) {
        if (me.done[i - me.pc]) continue;
        const auto& a = s.actions[r][i];
        if (!options.rendezvous_sends()) {  // a receive takes a buffered send
          const auto it = mailbox.find(key_of(a.kind, a.stage, a.microbatch));
          if (it == mailbox.end()) continue;
          me.done[i - me.pc] = 1;
          me.clock = std::max(me.clock, std::max(me.posted_at, it->second));
          mailbox.erase(it);
          moved = true;
          continue;
        }
        const auto [want, peer] = counterpart(s, a);
        auto& other = ranks[peer];
        if (!other.posted) continue;
        for (size_t j = other.pc; j < other.batch_end; ++j) {
          const auto& b = s.actions[peer][j];
          if (other.done[j - other.pc] || b.kind != want.kind || b.stage != want.stage || b.microbatch != want.microbatch) continue;
          const double at = std::max(me.posted_at, other.posted_at);
          me.done[i - me.pc] = 1;
          other.done[j - other.pc] = 1;
          me.clock = std::max(me.clock, at);
          other.clock = std::max(other.clock, at);
          moved = true;
          break;
        }
      }
      if (finish_batch(r)) moved = true;
    }
    for (int r = 0; r < s.ranks; ++r) {
      if (ranks[r].posted && finish_batch(r)) moved = true;
    }
  }

  std::ostringstream stuck;
  for (int r = 0; r < s.ranks; ++r) {
    if (ranks[r].pc < s.actions[r].size()) stuck << "\n  " << where(r, ranks[r].pc) << " waits";
  }
  if (!stuck.str().empty()) {
    fail("simulate " + s.name + ": the schedule deadlocks" +
         (options.rendezvous_sends() ? " when sends complete only once received:" : ":") + stuck.str());
  }
  if (!mailbox.empty()) {
    const auto& [kind, stage, mb] = mailbox.begin()->first;
    fail("simulate " + s.name + ": nobody receives " + Action{static_cast<Kind>(kind), stage, mb}.to_string() +
         " (" + std::to_string(mailbox.size()) + " sends not received)");
  }
  for (int stage = 0; stage <= last; ++stage) {
    for (int mb = 0; mb < s.microbatches; ++mb) {
      for (Kind kind : {Kind::kForward, Kind::kBackward, Kind::kBackwardWeight}) {
        if (kind == Kind::kBackwardWeight && !split) continue;
        if (!computed.count(key_of(kind, stage, mb))) {
          fail("simulate " + s.name + ": no rank runs " + Action{kind, stage, mb}.to_string());
        }
      }
    }
  }
  for (const auto& r : ranks) result.makespan = std::max(result.makespan, r.clock);
  double idle = 0;
  for (const auto& r : ranks) {
    result.busy.push_back(r.busy);
    result.idle.push_back(result.makespan - r.busy);
    idle += result.makespan - r.busy;
  }
  result.bubble_fraction = result.makespan > 0 ? idle / (s.ranks * result.makespan) : 0;
  return result;
}

double bubble_fraction_closed_form(int ranks, int microbatches, int stages_per_rank) {
  return static_cast<double>(ranks - 1) / (static_cast<double>(stages_per_rank) * microbatches + ranks - 1);
}

double bubble_fraction_closed_form(const std::string& schedule, int ranks, int microbatches, int stages_per_rank,
                                   const SimulationOptions& costs) {
  if (schedule == "zbh1") {
    const double f = costs.forward(), w = costs.backward_weight(), b = costs.backward() - w;
    const double idle = (ranks - 1) * (f + b - w);
    return idle / (microbatches * (f + b + w) + idle);
  }
  if (schedule != "gpipe" && schedule != "1f1b" && schedule != "interleaved") {
    fail("bubble_fraction_closed_form: unknown schedule \"" + schedule + "\" (gpipe, 1f1b, interleaved, zbh1)");
  }
  return bubble_fraction_closed_form(ranks, microbatches, schedule == "interleaved" ? stages_per_rank : 1);
}

}  // namespace commgrad::pp
