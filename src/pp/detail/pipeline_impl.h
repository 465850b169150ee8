#pragma once
// Pipeline::Impl, the state of one rank's part of a schedule, shared by
// pipeline.cpp (running actions) and pipeline_wire.cpp (messages between
// stages). Internal to commgrad_pp.

#include "commgrad/pp/pipeline.h"

#include "commgrad/ops/raw.h"
#include "commgrad/tp/weight_gradients.h"

#include <ATen/core/Tensor.h>
#include <c10/util/StringUtil.h>

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace commgrad::pp {
namespace detail::pipeline {

constexpr const char* kOp = "Pipeline";
constexpr int64_t kMagic = 0x636770;  // "cgp"
constexpr int64_t kMaxDims = 6;
constexpr int64_t kHeaderSize = 6 + kMaxDims;
constexpr int64_t kErrorKind = 2;  // header kind of an error message (0 activation, 1 gradient)

using Key = std::pair<int, int>;  // stage, microbatch

inline bool is_activation(ActionKind kind) {
  return kind == ActionKind::kSendActivation || kind == ActionKind::kRecvActivation;
}

// The stage that receives what `a` sends or receives.
inline int receiving_stage(const Action& a) {
  switch (a.kind) {
    case ActionKind::kSendActivation:
      return a.stage + 1;
    case ActionKind::kSendGradient:
      return a.stage - 1;
    default:
      return a.stage;
  }
}

inline int tag_of(const Action& a) { return 2 * receiving_stage(a) + (is_activation(a.kind) ? 0 : 1); }

}  // namespace detail::pipeline

struct Pipeline::Impl {
  std::vector<StageFunction> stages;
  LossFunction loss;
  PipelineOptions options{1};
  Group group;
  Schedule schedule;
  int rank = 0;
  // The last B and the last W, after which the gradients are reduced over
  // data parallelism: per stage (stage -> microbatch), and the rank's last.
  std::map<int, int> last_of[2];
  Action rank_last[2] = {{ActionKind::kBackward, 0, 0}, {ActionKind::kBackwardWeight, 0, 0}};
  std::map<int, bool> deferring;               // split backward: stage -> its forwards deferred weight gradients
  Action current{ActionKind::kForward, 0, 0};  // what runs now (for errors)

  struct Slot {
    at::Tensor input, output, loss, grad_output, grad_input;
    tp::WeightGradients weights;  // split backward: deferred by the forward, computed by W
  };
  std::map<detail::pipeline::Key, Slot> slots;
  std::vector<std::pair<ops::raw::Pending, at::Tensor>> sends;  // kept alive until waited for
  std::deque<Action> receives;   // posted by a batch, taken when a computation needs them
  size_t position = 0;           // this rank's first action not yet started (or posted)
  bool neighbours_told = false;  // this step's failure was passed on
  // Error messages sent and not yet received: a failed neighbour may never
  // take them, and the transport may still read their memory.
  std::vector<std::pair<ops::raw::Pending, at::Tensor>> error_sends;
  std::vector<double> losses;
  at::Tensor inputs, targets;

  int last_stage() const { return schedule.stages() - 1; }
  std::string where(const Action& a) const {
    return c10::str("stage ", a.stage, " microbatch ", a.microbatch, " (", a.to_string(), ")");
  }
  at::Tensor microbatch_of(const at::Tensor& batch, int mb) const { return batch.chunk(schedule.microbatches, 0)[mb]; }
  void forward(const Action& a);
  void backward(const Action& a);
  void backward_weight(const Action& a);
  std::shared_ptr<void> hold_sync(const Action& a) const;
  void post_send(const Action& a);
  void post(const Action& a);
  void receive_for(const Action& compute);
  void receive(const Action& a);
  void tell_neighbours(const std::string& what, int except);
  void send_header(const at::Tensor& data, int64_t kind, const Action& a);

  // One step, in order: start it, run every action (timing the
  // computations), finish its communication, report.
  using Clock = std::chrono::steady_clock;
  struct Busy {
    Clock::duration of[3]{};  // forward, backward, W
  };
  void start_step(const at::Tensor& step_inputs, const at::Tensor& step_targets);
  void check_batch(const at::Tensor& t, const char* what) const;
  void run_compute(const Action& a, Busy& busy);
  void run_actions(Busy& busy);
  void finish_communication();
  void abandon_step(const std::exception& e);
  PipelineStepResult report(const Busy& busy, Clock::time_point start);
};

}  // namespace commgrad::pp
