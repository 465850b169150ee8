#pragma once
// The pipeline simulator: runs every rank's list of a Schedule, proves it
// free of deadlock, checks every data dependency and counts idle time.
//
// Every rank walks its list with its own clock. A computation takes its
// cost; a batch is posted at the rank's clock and each of its operations
// completes when the peer has posted the matching one, at the later of the
// two posting times (no transfer time: the bubble is a property of the
// order). With buffered sends (the default) a send is done when posted and
// its receive completes at the later of the two posting times; with
// rendezvous sends a send waits for its receive. The rank moves on when its
// whole batch is done. When no rank can move and some have not finished,
// the schedule deadlocks.

#include "commgrad/pp/schedule.h"

#include <torch/arg.h>

#include <string>
#include <vector>

namespace commgrad::pp {

/// How the simulator runs a schedule: what a computation costs (time units
/// per stage), and when a send completes.
struct SimulationOptions {
  TORCH_ARG(double, forward) = 1.0;
  /// A whole backward; in schedules that split it, B costs backward -
  /// backward_weight and W backward_weight.
  TORCH_ARG(double, backward) = 2.0;
  TORCH_ARG(double, backward_weight) = 1.0;
  /// true: a send completes only when the matching receive is posted (the
  /// strictest transport: no buffering at all). false: a send completes when
  /// posted and its data waits for the receive (a transport that buffers, as
  /// asynchronous sends waited for later do); the bubble's closed forms
  /// assume this.
  TORCH_ARG(bool, rendezvous_sends) = false;
};

/// The simulated run of a schedule.
struct SimulationResult {
  double makespan = 0;       ///< until the last rank finished
  std::vector<double> busy;  ///< computing time, by rank
  std::vector<double> idle;  ///< makespan - busy, by rank
  /// Idle share of all ranks' time: sum(idle) / (ranks * makespan).
  double bubble_fraction = 0;
  /// Largest number of microbatches whose forward ran but backward did not
  /// yet, on any rank (activation memory).
  int peak_in_flight = 0;
  /// Split schedules: the largest number of microbatches whose B ran but W
  /// did not yet, on any rank (the weight-gradient inputs held).
  int peak_awaiting_weight = 0;
};

/// Runs every rank's list. Throws, naming the rank and action, when the
/// schedule deadlocks (every rank waits), computes before its input arrived,
/// sends what it has not computed, receives what no rank sends, or leaves a
/// forward or backward (or, split, a W) of some stage and microbatch out or
/// runs it twice.
SimulationResult simulate(const Schedule& schedule, const SimulationOptions& options = {});

/// The closed form of the bubble for a schedule with balanced stages:
/// (p - 1) / (m + p - 1) for GPipe and 1F1B, and (p - 1) / (v m + p - 1)
/// for interleaved 1F1B with v stages per rank.
double bubble_fraction_closed_form(int ranks, int microbatches, int stages_per_rank = 1);

/// The same by schedule name. For "zbh1" it depends on the costs of F, B
/// and W (`costs`: forward, backward - backward_weight, backward_weight):
/// (p - 1)(F + B - W) / (m (F + B + W) + (p - 1)(F + B - W)) (Qi et al.),
/// which its order reaches while W <= B; (p - 1) / (3 m + p - 1) for equal
/// costs (the defaults).
double bubble_fraction_closed_form(const std::string& schedule, int ranks, int microbatches, int stages_per_rank = 1,
                                   const SimulationOptions& costs = {});

}  // namespace commgrad::pp
