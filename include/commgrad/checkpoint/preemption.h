#pragma once
// checkpoint::Preemption: turns a scheduler's warning into a clean stop.
//
// Schedulers warn a job before they take its nodes: Kubernetes and most
// launchers send SIGTERM, Slurm sends the signal of `--signal=USR1@90`
// ninety seconds early. A Preemption catches those signals (a handler that
// only sets a flag); the training loop asks requested() once per step, which
// all-reduces the flag so that every rank stops after the same step, saves a
// checkpoint and exits with kExitPreempted, which commgrad-run does not count
// as a failure. A second signal of the same kind kills the process at once
// (the handler is back to the default): a checkpoint interrupted that way is
// never published, so the previous one stays the one `latest` names.

#include "commgrad/dist/group.h"

#include <torch/arg.h>

#include <csignal>
#include <vector>

namespace commgrad::checkpoint {

/// Exit status of a program that stopped because it was preempted, after
/// saving a checkpoint (EX_TEMPFAIL; commgrad-run passes it on and does not
/// spend a restart on it).
inline constexpr int kExitPreempted = 75;

/// Options of Preemption.
///
/// Example:
///   checkpoint::Preemption preemption(checkpoint::PreemptionOptions().signals({SIGUSR1}));
struct PreemptionOptions {
  /// The signals that ask for a checkpoint and a stop.
  TORCH_ARG(std::vector<int>, signals) = std::vector<int>{SIGTERM, SIGUSR1};
};

/// Installs the handlers for its lifetime (one Preemption at a time per
/// process; the previous handlers come back when it is destroyed).
///
/// Example:
///   checkpoint::Preemption preemption;
///   for (int step = start; step < steps; ++step) {
///     train(step);
///     if (preemption.requested()) {         // collective: every rank, every step
///       save(step + 1);
///       return checkpoint::kExitPreempted;
///     }
///   }
class Preemption {
 public:
  explicit Preemption(PreemptionOptions options = {});
  ~Preemption();
  Preemption(const Preemption&) = delete;
  Preemption& operator=(const Preemption&) = delete;

  /// Collective over `group` (empty: the world): true on every rank when any
  /// rank has received one of the signals (an all-reduce MAX of one integer).
  bool requested(const Group& group = Group()) const;

  /// The first of the signals this process received, or 0 (no communication).
  int received() const;

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

}  // namespace commgrad::checkpoint
