#pragma once

// commgrad-run's elastic rendezvous (--nnodes MIN:MAX): before every start of
// the job, the node agents (one commgrad-run per node) meet at
// --master-addr:--master-port. The agent that can bind that address hosts
// the rendezvous and is node 0 of every round; the others connect, send a
// join line and wait for their node rank, the number of nodes of the round
// and the port of the ranks' own rendezvous (the host picks a free one each
// round). The rules of a round (when it closes, when it fails) are in
// rendezvous_round.h.
//
// The host answers only while it is between two starts. While the ranks
// run, each agent watches for news of a new round (watch_fd()): the host
// sees a node knock at its listening socket (a node whose ranks failed, or
// a new one), a guest hears "restart" from the host on the connection it
// joined with (the host's ranks failed). Either then stops its ranks and
// joins the next round; that is not counted as a restart (as in torchrun).
// So a failed rank ends the start on every node, also when the other ranks
// would only notice after their collective timeout; an agent that does not
// come back is left out once the last call has passed.
//
// Example:
//   Rendezvous rdzv(options, job_id);
//   if (!rdzv.open(&error)) ...;
//   RendezvousResult r = rdzv.next_round(wake_fd, interrupted, time_left_s);
//   // r.assignment.node_rank, r.assignment.nodes, r.assignment.port

#include <functional>
#include <string>
#include <vector>

#include "options.h"
#include "rendezvous_round.h"

namespace commgrad::run {

/// One round's outcome: the assignment, or why there is none.
struct RendezvousResult {
  bool ok = false;
  bool interrupted = false;  // `interrupted()` said stop (a signal to the launcher)
  bool timed_out = false;    // `time_left_s` ran out (the launcher's --timeout)
  RoundAssignment assignment;
  std::string error;
};

class Rendezvous {
 public:
  Rendezvous(const LaunchOptions& options, std::string job_id);
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  ~Rendezvous();

  /// Hosts the rendezvous when --master-addr:--master-port can be bound
  /// here, else becomes a guest. False (with `*error`) when neither works.
  bool open(std::string* error);
  bool hosting() const { return listen_fd_ >= 0; }

  /// Runs the next round to its end. When `wake_fd` becomes readable it
  /// calls `interrupted()`; true ends the round with `interrupted` set.
  /// After `time_left_s` it ends with `timed_out` set.
  RendezvousResult next_round(int wake_fd, const std::function<bool()>& interrupted, double time_left_s);

  /// While the round's ranks run: the socket that brings news of a new
  /// round (see the file comment), or -1.
  int watch_fd() const { return hosting() ? listen_fd_ : member_fd_; }
  /// After watch_fd() became readable: true when a new round is wanted.
  bool new_round_wanted();

 private:
  RendezvousResult host_round(int wake_fd, const std::function<bool()>& interrupted, double stop_at_s);
  RendezvousResult guest_round(int wake_fd, const std::function<bool()>& interrupted, double stop_at_s);
  std::string endpoint() const;

  LaunchOptions options_;
  std::string job_id_;
  int listen_fd_ = -1;
  int round_ = 0;
  std::vector<int> members_;  // the host's: guests of the last round, told "restart" when the next opens
  int member_fd_ = -1;        // a guest's: its connection to the host during the round
  std::string member_buf_;
};

}  // namespace commgrad::run
