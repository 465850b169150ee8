#pragma once
// Pipeline schedules as data: each rank's list of actions (compute a
// microbatch on a stage, send or receive an activation or a gradient).
// pp/simulator.h runs them: it proves every generated schedule free of
// deadlock under the strictest transport (a send completes only when its
// receive is posted), checks every data dependency and counts idle time.
//
// Stages are virtual: with v stages per rank (interleaved schedules) stage s
// lives on rank s % ranks, so a model of ranks * v stages visits every rank v
// times. Actions between two computations that are posted together form a
// batch (`batched_with_next`), as torch.distributed.batch_isend_irecv posts
// them: a rank posts all of a batch's sends and receives, then waits for all.

#include <torch/arg.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace commgrad::pp {

enum class ActionKind {
  kForward,         ///< forward of a microbatch on a stage
  kBackward,        ///< backward: input and weight gradients, or only the input gradient ("B") in
                    ///< schedules with kBackwardWeight
  kSendActivation,  ///< the stage's output to the next stage's rank
  kRecvActivation,  ///< the previous stage's output, the stage's input
  kSendGradient,    ///< the gradient of the stage's input to the previous stage's rank
  kRecvGradient,    ///< the gradient of the stage's output, from the next stage's rank
  kBackwardWeight,  ///< the weight gradients held back by the microbatch's backward ("W")
};

/// One step of a rank's list.
///
/// Example:
///   pp::Action{pp::ActionKind::kForward, /*stage=*/1, /*microbatch=*/3}   // "F1.3"
struct Action {
  ActionKind kind;
  int stage = 0;  ///< the (virtual) stage computing, sending or receiving
  int microbatch = 0;
  /// Posted together with the next action (both must be communication).
  bool batched_with_next = false;

  bool is_compute() const {
    return kind == ActionKind::kForward || kind == ActionKind::kBackward || kind == ActionKind::kBackwardWeight;
  }
  /// "F1.3", "B0.2", "W0.2", "sendA1.3" (stage 1's output of microbatch 3), "recvG0.2", ...
  std::string to_string() const;
  bool operator==(const Action& other) const {
    return kind == other.kind && stage == other.stage && microbatch == other.microbatch &&
           batched_with_next == other.batched_with_next;
  }
};

std::ostream& operator<<(std::ostream& out, const Action& action);

/// Every rank's list of actions for one training step.
struct Schedule {
  std::string name;
  int ranks = 1;
  int stages_per_rank = 1;  ///< v; stage s is on rank s % ranks
  int microbatches = 1;
  std::vector<std::vector<Action>> actions;  ///< by rank

  int stages() const { return ranks * stages_per_rank; }
  /// The backward is split into B and W actions (zero-bubble schedules).
  bool splits_backward() const;
  int rank_of(int stage) const { return stage % ranks; }
  /// One line per rank: "rank 0: F0.0 sendA0.0 F0.1 ...".
  std::string describe() const;
};

/// GPipe: all forwards, then all backwards (Huang et al., arXiv 1811.06965).
/// Activations of all m microbatches are alive at once.
Schedule gpipe(int ranks, int microbatches);

/// 1F1B (PipeDream-Flush; Narayanan et al., arXiv 2104.04473): ranks - r - 1
/// warm-up forwards on rank r, then one forward and one backward in turn,
/// then the remaining backwards. At most ranks - r microbatches in flight.
Schedule one_f_one_b(int ranks, int microbatches);

/// Interleaved 1F1B with `stages_per_rank` virtual stages per rank
/// (Megatron-LM's schedule); needs microbatches % ranks == 0.
Schedule interleaved_one_f_one_b(int ranks, int microbatches, int stages_per_rank);

/// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241):
/// 1F1B with the backward split into B, the input gradient the previous
/// stage waits for, and W, the weight gradients, which fill the time rank r
/// would wait for gradients. Rank r holds at most ranks - r microbatches
/// between F and B (as in 1F1B) and at most ranks - 1 more between B and W.
/// The order is list scheduling with F, B and W of equal cost (B before F
/// before W, whichever is ready), which reaches the closed form
/// (p - 1) / (3 m + p - 1).
Schedule zero_bubble_h1(int ranks, int microbatches);

/// "gpipe", "1f1b", "interleaved" (with stages_per_rank) or "zbh1"; errors
/// name the valid choices.
Schedule make_schedule(const std::string& name, int ranks, int microbatches, int stages_per_rank = 1);

}  // namespace commgrad::pp
