#include "rendezvous_round.h"

#include <cstdio>
#include <sstream>

namespace commgrad::run {
namespace {

constexpr const char* kMagic = "commgrad-rdzv 1 ";

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%gs", s);
  return buf;
}

// The words of `line` after the magic prefix, or false when it is not there.
bool after_magic(const std::string& line, std::string* rest) {
  const std::string magic = kMagic;
  if (line.compare(0, magic.size(), magic) != 0) return false;
  *rest = line.substr(magic.size());
  return true;
}

}  // namespace

RoundState::RoundState(RoundRule rule, double start_s) : rule_(rule), start_s_(start_s) {}

void RoundState::joined(double now_s) {
  ++nodes_;
  if (nodes_ >= rule_.min_nodes && !min_reached_s_) min_reached_s_ = now_s;
}

void RoundState::left(double /*now_s*/) {
  if (nodes_ > 0) --nodes_;
  if (nodes_ < rule_.min_nodes) min_reached_s_.reset();  // the last call starts again at MIN
}

RoundDecision RoundState::decide(double now_s) const {
  if (nodes_ >= rule_.max_nodes) return {RoundVerdict::kClose, 0.0};
  if (min_reached_s_) {
    const double left = *min_reached_s_ + rule_.last_call_s - now_s;
    return left <= 0 ? RoundDecision{RoundVerdict::kClose, 0.0} : RoundDecision{RoundVerdict::kWait, left};
  }
  const double left = start_s_ + rule_.join_timeout_s - now_s;
  return left <= 0 ? RoundDecision{RoundVerdict::kFail, 0.0} : RoundDecision{RoundVerdict::kWait, left};
}

std::string RoundState::failure() const {
  return std::to_string(nodes_) + " of at least " + std::to_string(rule_.min_nodes) +
         (rule_.min_nodes == 1 ? " node" : " nodes") + " joined within --rdzv-join-timeout " +
         seconds(rule_.join_timeout_s);
}

std::string join_line(const std::string& job_id, int nproc_per_node) {
  return std::string(kMagic) + "join " + (job_id.empty() ? "-" : job_id) + " " + std::to_string(nproc_per_node);
}

std::optional<std::string> refusal(const std::string& line, const std::string& job_id, int nproc_per_node) {
  std::string rest;
  std::string word, id;
  int nproc = 0;
  std::istringstream in;
  if (after_magic(line, &rest)) in.str(rest);
  if (rest.empty() || !(in >> word >> id >> nproc) || word != "join") {
    return "not a commgrad-run of this version (it sent '" + line.substr(0, 80) + "')";
  }
  const std::string ours = job_id.empty() ? "-" : job_id;
  if (id != ours) {
    return "the rendezvous belongs to another job (--rdzv-id '" + ours + "'; this node has '" + id + "')";
  }
  if (nproc != nproc_per_node) {
    return "every node must start the same number of ranks: the rendezvous host has -n " +
           std::to_string(nproc_per_node) + ", this node -n " + std::to_string(nproc);
  }
  return std::nullopt;
}

std::string assignment_line(const RoundAssignment& a) {
  return std::string(kMagic) + "round " + std::to_string(a.round) + " " + std::to_string(a.node_rank) + " " +
         std::to_string(a.nodes) + " " + std::to_string(a.port);
}

std::string failure_line(const std::string& reason) { return std::string(kMagic) + "fail " + reason; }

std::string restart_line() { return std::string(kMagic) + "restart"; }

std::optional<RoundAssignment> parse_answer(const std::string& line, std::string* error) {
  std::string rest;
  if (!after_magic(line, &rest)) {
    *error = "the rendezvous answered '" + line.substr(0, 80) + "' (not a commgrad-run of this version?)";
    return std::nullopt;
  }
  if (rest.compare(0, 5, "fail ") == 0) {
    *error = rest.substr(5);
    return std::nullopt;
  }
  std::istringstream in(rest);
  std::string word;
  RoundAssignment a;
  if (!(in >> word >> a.round >> a.node_rank >> a.nodes >> a.port) || word != "round" || a.nodes < 1 ||
      a.node_rank < 0 || a.node_rank >= a.nodes || a.port < 1 || a.port > 65535) {
    *error = "the rendezvous answered '" + line.substr(0, 80) + "', which is not a round";
    return std::nullopt;
  }
  return a;
}

}  // namespace commgrad::run
