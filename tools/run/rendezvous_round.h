#pragma once

// The rules of one round of commgrad-run's elastic rendezvous (--nnodes
// MIN:MAX), apart from the sockets that carry it (rendezvous.h), so that they
// can be tested on their own: when a round closes, when it fails, and the
// lines the node agents exchange.
//
// A round closes as soon as MAX nodes joined, or once MIN joined and the last
// call (`last_call_s`, counted from the moment MIN was reached) has passed;
// it fails when MIN have not joined within `join_timeout_s` of its start.
// These are torchrun's join_timeout and last_call_timeout.
//
// Example:
//   RoundState round(RoundRule{1, 2, 600, 30}, /*start_s=*/0);
//   round.joined(0);                 // the host itself
//   round.decide(0.5).verdict;       // kWait: MIN is here, the last call runs until 30
//   round.joined(1.0);               // a second node
//   round.decide(1.0).verdict;       // kClose: MAX joined

#include <optional>
#include <string>

namespace commgrad::run {

/// MIN and MAX nodes and the two timeouts of a round.
struct RoundRule {
  int min_nodes = 1;
  int max_nodes = 1;
  double join_timeout_s = 600.0;
  double last_call_s = 30.0;
};

enum class RoundVerdict { kWait, kClose, kFail };

/// What to do now, and for how long to wait at most before asking again
/// (meaningful with kWait).
struct RoundDecision {
  RoundVerdict verdict = RoundVerdict::kWait;
  double wait_s = 0.0;
};

/// The nodes of one round as they come and go (times in seconds on any
/// steady clock).
class RoundState {
 public:
  RoundState(RoundRule rule, double start_s);

  /// A node joined / a joined node went away before the round closed.
  void joined(double now_s);
  void left(double now_s);

  RoundDecision decide(double now_s) const;
  int nodes() const { return nodes_; }
  /// Why the round failed, for the message: "1 of at least 2 nodes joined
  /// within --rdzv-join-timeout 5s".
  std::string failure() const;

 private:
  RoundRule rule_;
  double start_s_;
  int nodes_ = 0;
  std::optional<double> min_reached_s_;  // when the nodes last reached MIN
};

/// A node agent's request to join: "commgrad-rdzv 1 join <job id or -> <nproc per node>".
std::string join_line(const std::string& job_id, int nproc_per_node);

/// The host's answer to a join line of another node: nothing when it may
/// join; otherwise why not (another job's id, another number of ranks per node).
std::optional<std::string> refusal(const std::string& line, const std::string& job_id, int nproc_per_node);

/// What a node is told when the round closes: its node rank, the nodes of
/// the round and the port of the ranks' own rendezvous (MASTER_PORT).
struct RoundAssignment {
  int round = 0;
  int node_rank = 0;
  int nodes = 1;
  int port = 0;
};

/// "commgrad-rdzv 1 round <round> <node rank> <nodes> <port>"
std::string assignment_line(const RoundAssignment& a);
/// "commgrad-rdzv 1 fail <reason>": the round failed, or this node was refused.
std::string failure_line(const std::string& reason);
/// "commgrad-rdzv 1 restart": the host opened a new round; the nodes of the
/// last one stop their ranks and join it.
std::string restart_line();

/// A line from the host: the assignment, or (in `error`) the host's reason
/// for a failure, or what is wrong with a line that is neither.
std::optional<RoundAssignment> parse_answer(const std::string& line, std::string* error);

}  // namespace commgrad::run
