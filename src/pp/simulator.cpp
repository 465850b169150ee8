// The pipeline simulator (pp/simulator.h): one Simulator per run, each step
// of the header's rules one method.

#include "commgrad/pp/simulator.h"

#include "detail/actions.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

namespace commgrad::pp {
namespace {

using detail::ActionKey;
using detail::fail;
using detail::key_of;
using Kind = ActionKind;

class Simulator {
 public:
  Simulator(const Schedule& s, const SimulationOptions& options);
  SimulationResult run();

 private:
  struct Rank {
    size_t pc = 0;  // next action
    double clock = 0;
    double busy = 0;
    bool posted = false;  // the batch at pc is posted
    double posted_at = 0;
    size_t batch_end = 0;      // one past the batch's last action
    std::vector<char> done;    // per action of the batch
    std::set<ActionKey> have;  // computed or received here
    int in_flight = 0;
    int awaiting_weight = 0;
  };

  std::string where(int r, size_t i) const {
    return "rank " + std::to_string(r) + " action " + std::to_string(i) + " (" + s_.actions[r][i].to_string() + ")";
  }
  [[noreturn]] void fail_at(int r, size_t i, const std::string& what) const {
    fail("simulate " + s_.name + ": " + where(r, i) + " " + what);
  }
  void need(int r, size_t i, Kind kind, int stage, int mb, const char* what) const {
    if (!ranks_[r].have.count(key_of(kind, stage, mb))) fail_at(r, i, what);
  }
  void check_inputs(int r, size_t i, const Action& a) const;
  double cost_of(Rank& me, const Action& a);
  void compute(int r);
  void post(int r);
  bool match(int r);
  bool match_with_peer(int r, size_t i, const Action& a);
  bool finish_batch(int r);
  void check_finished() const;
  SimulationResult summary();

  const Schedule& s_;
  const SimulationOptions& options_;
  const bool split_;
  const int last_;
  std::vector<Rank> ranks_;
  std::map<ActionKey, int> computed_;    // F, B and W per (stage, microbatch)
  std::map<ActionKey, double> mailbox_;  // buffered sends, by the receive they match: posting time
  SimulationResult result_;
};

Simulator::Simulator(const Schedule& s, const SimulationOptions& options)
    : s_(s), options_(options), split_(s.splits_backward()), last_(s.stages() - 1), ranks_(s.ranks) {
  if (static_cast<int>(s.actions.size()) != s.ranks) {
    fail("simulate " + s.name + ": " + std::to_string(s.actions.size()) + " action lists for " +
         std::to_string(s.ranks) + " ranks");
  }
  if (split_ && (options.backward_weight() < 0 || options.backward_weight() > options.backward())) {
    fail("simulate " + s.name + ": backward_weight (" + std::to_string(options.backward_weight()) +
         ") must lie between 0 and backward (" + std::to_string(options.backward()) + ")");
  }
}

// The inputs of computation `a` (action i of rank r) are here.
void Simulator::check_inputs(int r, size_t i, const Action& a) const {
  if (a.stage < 0 || a.stage > last_ || s_.rank_of(a.stage) != r) fail_at(r, i, "is not a stage of this rank");
  if (a.microbatch < 0 || a.microbatch >= s_.microbatches) fail_at(r, i, "has no such microbatch");
  if (a.kind == Kind::kForward) {
    if (a.stage == 0) return;
    if (s_.rank_of(a.stage - 1) == r) {
      need(r, i, Kind::kForward, a.stage - 1, a.microbatch, "runs before the forward of the previous stage");
    } else {
      need(r, i, Kind::kRecvActivation, a.stage, a.microbatch, "runs before its activation was received");
    }
  } else if (a.kind == Kind::kBackward) {
    need(r, i, Kind::kForward, a.stage, a.microbatch, "runs before the forward of the same microbatch");
    if (a.stage == last_) return;
    if (s_.rank_of(a.stage + 1) == r) {
      need(r, i, Kind::kBackward, a.stage + 1, a.microbatch, "runs before the backward of the next stage");
    } else {
      need(r, i, Kind::kRecvGradient, a.stage, a.microbatch, "runs before its output gradient was received");
    }
  } else {
    need(r, i, Kind::kBackward, a.stage, a.microbatch, "runs before the backward of the same microbatch");
  }
}

// The cost of computation `a`, counting what it keeps alive.
double Simulator::cost_of(Rank& me, const Action& a) {
  if (a.kind == Kind::kForward) {
    result_.peak_in_flight = std::max(result_.peak_in_flight, ++me.in_flight);
    return options_.forward();
  }
  if (a.kind == Kind::kBackward) {
    --me.in_flight;
    if (!split_) return options_.backward();
    result_.peak_awaiting_weight = std::max(result_.peak_awaiting_weight, ++me.awaiting_weight);
    return options_.backward() - options_.backward_weight();
  }
  --me.awaiting_weight;
  return options_.backward_weight();
}

void Simulator::compute(int r) {
  auto& me = ranks_[r];
  const size_t i = me.pc;
  const auto& a = s_.actions[r][i];
  check_inputs(r, i, a);
  const double cost = cost_of(me, a);
  me.busy += cost;
  me.clock += cost;
  if (++computed_[key_of(a)] > 1) fail_at(r, i, "runs twice");
  me.have.insert(key_of(a));
  ++me.pc;
}

// Posts the batch at pc (once) and checks what a send sends; buffered sends
// are done at once.
void Simulator::post(int r) {
  auto& me = ranks_[r];
  if (me.posted) return;
  me.posted = true;
  me.posted_at = me.clock;
  me.batch_end = me.pc;
  while (me.batch_end < s_.actions[r].size() && s_.actions[r][me.batch_end].batched_with_next) ++me.batch_end;
  if (me.batch_end == s_.actions[r].size())
    fail("simulate " + s_.name + ": rank " + std::to_string(r) + " ends inside a batch");
  ++me.batch_end;
  me.done.assign(me.batch_end - me.pc, 0);
  for (size_t i = me.pc; i < me.batch_end; ++i) {
    const auto& a = s_.actions[r][i];
    if (a.is_compute()) fail_at(r, i, "is a computation inside a batch");
    const int peer_stage = detail::counterpart(s_, a).first.stage;
    if (a.stage < 0 || a.stage > last_ || s_.rank_of(a.stage) != r || peer_stage < 0 || peer_stage > last_ ||
        s_.rank_of(peer_stage) == r) {
      fail_at(r, i, "has no peer stage on another rank");
    }
    if (a.microbatch < 0 || a.microbatch >= s_.microbatches) fail_at(r, i, "has no such microbatch");
    if (a.kind == Kind::kSendActivation)
      need(r, i, Kind::kForward, a.stage, a.microbatch, "sends an activation not computed yet");
    if (a.kind == Kind::kSendGradient)
      need(r, i, Kind::kBackward, a.stage, a.microbatch, "sends a gradient not computed yet");
    const bool send = a.kind == Kind::kSendActivation || a.kind == Kind::kSendGradient;
    if (send && !options_.rendezvous_sends()) {
      if (!mailbox_.emplace(key_of(detail::counterpart(s_, a).first), me.posted_at).second)
        fail_at(r, i, "is sent twice");
      me.done[i - me.pc] = 1;
    }
  }
}

// Completes what it can of rank r's posted batch; true when anything did.
bool Simulator::match(int r) {
  auto& me = ranks_[r];
  bool moved = false;
  for (size_t i = me.pc; i < me.batch_end; ++i) {
    if (me.done[i - me.pc]) continue;
    const auto& a = s_.actions[r][i];
    if (options_.rendezvous_sends()) {
      moved = match_with_peer(r, i, a) || moved;
      continue;
    }
    const auto it = mailbox_.find(key_of(a));  // a receive takes a buffered send
    if (it == mailbox_.end()) continue;
    me.done[i - me.pc] = 1;
    me.clock = std::max(me.clock, std::max(me.posted_at, it->second));
    mailbox_.erase(it);
    moved = true;
  }
  return moved;
}

// Rendezvous: action i of rank r completes with the matching operation of
// the peer's posted batch, at the later of the two posting times.
bool Simulator::match_with_peer(int r, size_t i, const Action& a) {
  auto& me = ranks_[r];
  const auto [want, peer] = detail::counterpart(s_, a);
  auto& other = ranks_[peer];
  if (!other.posted) return false;
  for (size_t j = other.pc; j < other.batch_end; ++j) {
    if (other.done[j - other.pc] || key_of(s_.actions[peer][j]) != key_of(want)) continue;
    const double at = std::max(me.posted_at, other.posted_at);
    me.done[i - me.pc] = 1;
    other.done[j - other.pc] = 1;
    me.clock = std::max(me.clock, at);
    other.clock = std::max(other.clock, at);
    return true;
  }
  return false;
}

bool Simulator::finish_batch(int r) {
  auto& me = ranks_[r];
  if (!me.posted || std::find(me.done.begin(), me.done.end(), 0) != me.done.end()) return false;
  for (size_t i = me.pc; i < me.batch_end; ++i) me.have.insert(key_of(s_.actions[r][i]));
  me.pc = me.batch_end;
  me.posted = false;
  return true;
}

// Every rank reached its end, every send was received, every F, B (and W)
// ran once.
void Simulator::check_finished() const {
  std::ostringstream stuck;
  for (int r = 0; r < s_.ranks; ++r) {
    if (ranks_[r].pc < s_.actions[r].size()) stuck << "\n  " << where(r, ranks_[r].pc) << " waits";
  }
  if (!stuck.str().empty()) {
    fail("simulate " + s_.name + ": the schedule deadlocks" +
         (options_.rendezvous_sends() ? " when sends complete only once received:" : ":") + stuck.str());
  }
  if (!mailbox_.empty()) {
    const auto& [kind, stage, mb] = mailbox_.begin()->first;
    fail("simulate " + s_.name + ": nobody receives " + Action{static_cast<Kind>(kind), stage, mb}.to_string() + " (" +
         std::to_string(mailbox_.size()) + " sends not received)");
  }
  for (int stage = 0; stage <= last_; ++stage) {
    for (int mb = 0; mb < s_.microbatches; ++mb) {
      for (Kind kind : {Kind::kForward, Kind::kBackward, Kind::kBackwardWeight}) {
        if (kind == Kind::kBackwardWeight && !split_) continue;
        if (!computed_.count(key_of(kind, stage, mb))) {
          fail("simulate " + s_.name + ": no rank runs " + Action{kind, stage, mb}.to_string());
        }
      }
    }
  }
}

SimulationResult Simulator::summary() {
  for (const auto& r : ranks_) result_.makespan = std::max(result_.makespan, r.clock);
  double idle = 0;
  for (const auto& r : ranks_) {
    result_.busy.push_back(r.busy);
    result_.idle.push_back(result_.makespan - r.busy);
    idle += result_.makespan - r.busy;
  }
  result_.bubble_fraction = result_.makespan > 0 ? idle / (s_.ranks * result_.makespan) : 0;
  return result_;
}

SimulationResult Simulator::run() {
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < s_.ranks; ++r) {
      auto& me = ranks_[r];
      while (me.pc < s_.actions[r].size() && s_.actions[r][me.pc].is_compute()) {
        compute(r);
        moved = true;
      }
      if (me.pc == s_.actions[r].size()) continue;
      post(r);
      if (match(r)) moved = true;
      if (finish_batch(r)) moved = true;
    }
    for (int r = 0; r < s_.ranks; ++r) {
      if (finish_batch(r)) moved = true;
    }
  }
  check_finished();
  return summary();
}

}  // namespace

SimulationResult simulate(const Schedule& schedule, const SimulationOptions& options) {
  return Simulator(schedule, options).run();
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
