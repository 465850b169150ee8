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
// The host answers only while it is between two starts: a node that joins
// while the host's ranks still run waits (in the listen queue) for the next
// round, up to --rdzv-join-timeout. A failed rank ends the start on every
// node (the other ranks' collectives fail), so every agent comes back to the
// rendezvous; one that does not is left out once the last call has passed.
//
// Example:
//   Rendezvous rdzv(options, job_id);
//   if (!rdzv.open(&error)) ...;
//   RendezvousResult r = rdzv.next_round(wake_fd, interrupted, time_left_s);
//   // r.assignment.node_rank, r.assignment.nodes, r.assignment.port

#include <functional>
#include <string>

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

 private:
  RendezvousResult host_round(int wake_fd, const std::function<bool()>& interrupted, double stop_at_s);
  RendezvousResult guest_round(int wake_fd, const std::function<bool()>& interrupted, double stop_at_s);
  std::string endpoint() const;

  LaunchOptions options_;
  std::string job_id_;
  int listen_fd_ = -1;
  int round_ = 0;
};

}  // namespace commgrad::run
