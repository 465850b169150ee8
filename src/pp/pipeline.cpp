// Pipeline: one rank's part of a schedule, executed.
//
// State per (stage, microbatch): the stage's input (a leaf that requires
// grad when it is an activation, so backward stops there and its gradient
// is what goes to the previous stage), its output, and on the last stage
// the loss, scaled by 1/m so that the gradients are those of the mean loss
// over the microbatches. Everything of a microbatch on a stage is dropped
// after its backward: only the microbatches in flight hold activations.
//
// Wire and errors: pipeline_wire.cpp (how stages exchange activations,
// gradients and the news of a failure).
//
// Split backward (zero-bubble schedules). A forward runs under
// tp::DeferWeightGradients, so the linear layers of the stage leave their
// weight gradients in the slot; B is the backward without them and W
// computes them. With data parallelism every B and W runs under no_sync
// but the rank's (or the stage's) last W, whose gradients reach the
// weights through autograd: their hooks fire with syncing on, and the
// reducer's end of backward then reduces every gradient accumulated since
// the last reduction.

#include "commgrad/pp/pipeline.h"

#include "detail/pipeline_impl.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/weight_gradients.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <utility>

namespace commgrad::pp {

using namespace detail::pipeline;  // the wire's constants and helpers

Pipeline::Pipeline(std::vector<StageFunction> stages, LossFunction loss, PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.group = ops::raw::resolve_group(options.group());
  m.rank = m.group.rank();
  COMMGRAD_CHECK(static_cast<bool>(loss), kOp, m.group, "the loss function is empty");
  m.schedule = make_schedule(options.schedule(), m.group.size(), options.microbatches(), options.stages_per_rank());
  COMMGRAD_CHECK(static_cast<int>(stages.size()) == options.stages_per_rank(), kOp, m.group, "the ", options.schedule(),
                 " schedule puts ", options.stages_per_rank(), " stage(s) on each rank, but this rank got ",
                 stages.size());
  for (size_t i = 0; i < stages.size(); ++i) {
    COMMGRAD_CHECK(static_cast<bool>(stages[i]), kOp, m.group, "stage function ", i, " is empty");
  }
  COMMGRAD_CHECK(options.no_sync().size() <= 1 || options.no_sync().size() == stages.size(), kOp, m.group,
                 "no_sync has ", options.no_sync().size(), " functions for ", stages.size(),
                 " stages on this rank (give one per stage, or one for all of them)");
  m.stages = std::move(stages);
  m.loss = std::move(loss);
  m.options = std::move(options);
  for (const auto& a : m.schedule.actions[m.rank]) {
    if (a.kind != ActionKind::kBackward && a.kind != ActionKind::kBackwardWeight) continue;
    const int w = a.kind == ActionKind::kBackwardWeight ? 1 : 0;
    m.last_of[w][a.stage] = a.microbatch;
    m.rank_last[w] = a;
  }
}

Pipeline::~Pipeline() = default;
Pipeline::Pipeline(Pipeline&&) noexcept = default;
Pipeline& Pipeline::operator=(Pipeline&&) noexcept = default;

const Schedule& Pipeline::schedule() const { return impl_->schedule; }
const Group& Pipeline::group() const { return impl_->group; }
std::vector<int> Pipeline::stages() const {
  std::vector<int> out;
  for (int v = 0; v < impl_->schedule.stages_per_rank; ++v) out.push_back(v * impl_->schedule.ranks + impl_->rank);
  return out;
}

void Pipeline::Impl::forward(const Action& a) {
  auto& slot = slots[{a.stage, a.microbatch}];
  if (a.stage == 0) {
    slot.input = microbatch_of(inputs, a.microbatch);
  } else if (schedule.rank_of(a.stage - 1) == rank) {
    const auto& prev = slots.at({a.stage - 1, a.microbatch}).output;
    slot.input = prev.detach().requires_grad_(prev.is_floating_point());
  }  // else: received into slot.input
  {
    std::optional<tp::DeferWeightGradients> defer;
    if (schedule.splits_backward()) defer.emplace(slot.weights);
    slot.output = stages[a.stage / schedule.ranks](slot.input);
  }
  if (slot.weights.deferring_layers() > 0) deferring[a.stage] = true;
  COMMGRAD_CHECK(slot.output.defined(), kOp, group, where(a), ": the stage returned an undefined tensor");
  if (a.stage == last_stage()) {
    const auto l = loss(slot.output, microbatch_of(targets, a.microbatch));
    COMMGRAD_CHECK(l.numel() == 1, kOp, group, where(a), ": the loss must be a scalar, got ", tensor_name(l));
    losses[a.microbatch] = l.item<double>();
    slot.loss = l / schedule.microbatches;
  }
}

// Data parallelism: only the stage's last backward of the step reduces.
// One function for several stages (one DistributedDataParallel over all of
// this rank's stages): only the rank's very last backward reduces. With a
// split backward that is the last W of a stage whose forwards deferred
// weight gradients (its hooks fire there), and the last B of one whose
// forwards deferred none (all of its gradients come in B).
std::shared_ptr<void> Pipeline::Impl::hold_sync(const Action& a) const {
  const auto& hold = options.no_sync();
  if (hold.empty()) return nullptr;
  const bool in_w = schedule.splits_backward() && deferring.count(a.stage);
  if (a.kind == (in_w ? ActionKind::kBackwardWeight : ActionKind::kBackward)) {
    const int w = in_w ? 1 : 0;
    if (hold.size() == 1 && stages.size() > 1) {
      if (a.stage == rank_last[w].stage && a.microbatch == rank_last[w].microbatch) return nullptr;
    } else if (last_of[w].at(a.stage) == a.microbatch) {
      return nullptr;
    }
  }
  return hold.size() == 1 ? hold.front()() : hold[a.stage / schedule.ranks]();
}

void Pipeline::Impl::backward(const Action& a) {
  auto& slot = slots.at({a.stage, a.microbatch});
  const auto no_sync = hold_sync(a);
  if (a.stage == last_stage()) {
    torch::autograd::backward({slot.loss});
  } else {
    if (schedule.rank_of(a.stage + 1) == rank) slot.grad_output = slots.at({a.stage + 1, a.microbatch}).grad_input;
    COMMGRAD_CHECK(slot.grad_output.sizes() == slot.output.sizes(), kOp, group, where(a),
                   ": the gradient of the output is ", tensor_name(slot.grad_output), ", but the output is ",
                   tensor_name(slot.output));
    torch::autograd::backward({slot.output}, {slot.grad_output});
  }
  if (a.stage > 0 && slot.input.requires_grad()) {
    slot.grad_input = slot.input.grad().defined() ? slot.input.grad() : at::zeros_like(slot.input);
  }
  // What the next stage's backward on this rank still needs stays; the rest goes.
  slot.output = at::Tensor();
  slot.loss = at::Tensor();
  slot.grad_output = at::Tensor();
  slot.input = at::Tensor();
  if (a.stage < last_stage() && schedule.rank_of(a.stage + 1) == rank) {
    const Key next{a.stage + 1, a.microbatch};
    slots.at(next).grad_input = at::Tensor();
    if (slots.at(next).weights.empty()) slots.erase(next);  // its W ran (or there is none)
  }
}

void Pipeline::Impl::backward_weight(const Action& a) {
  const auto it = slots.find({a.stage, a.microbatch});  // gone when its forward deferred nothing
  const bool deferred = it != slots.end() && !it->second.weights.empty();
  const auto no_sync = hold_sync(a);
  // Without a deferred gradient no hook would fire, and nothing would reduce.
  COMMGRAD_CHECK(no_sync || options.no_sync().empty() || deferred, kOp, group, where(a),
                 ": the gradients are to be reduced over data parallelism after this W, but this microbatch's "
                 "forward deferred no weight gradient while the stage's other forwards did");
  if (it == slots.end()) return;
  it->second.weights.compute();
  // The previous stage's B on this rank reads the input gradient here.
  if (a.stage > 0 && schedule.rank_of(a.stage - 1) == rank && it->second.grad_input.defined()) return;
  slots.erase(it);
}

void Pipeline::Impl::check_batch(const at::Tensor& t, const char* what) const {
  const int mbs = schedule.microbatches;
  COMMGRAD_CHECK(t.defined() && t.dim() >= 1, kOp, group, "step(): the ", what,
                 " must be a tensor of at least one dim on this rank, got ",
                 t.defined() ? tensor_name(t) : std::string("an undefined tensor"));
  COMMGRAD_CHECK(t.size(0) % mbs == 0, kOp, group, "step(): a batch of ", t.size(0), " ", what, " (", tensor_name(t),
                 ") does not split into ", mbs, " microbatches of equal size");
}

void Pipeline::Impl::start_step(const at::Tensor& step_inputs, const at::Tensor& step_targets) {
  inputs = step_inputs;
  targets = step_targets;
  losses.assign(schedule.microbatches, 0.0);
  slots.clear();
  sends.clear();
  receives.clear();
  position = 0;
  neighbours_told = false;
  deferring.clear();
  error_sends.erase(
      std::remove_if(error_sends.begin(), error_sends.end(), [](const auto& s) { return s.first.is_completed(); }),
      error_sends.end());
}

void Pipeline::Impl::run_compute(const Action& a, Busy& busy) {
  receive_for(a);
  current = a;
  const auto begin = Clock::now();
  int kind = 0;
  if (a.kind == ActionKind::kForward) {
    forward(a);
  } else if (a.kind == ActionKind::kBackward) {
    backward(a);
    kind = 1;
  } else {
    backward_weight(a);
    kind = 2;
  }
  busy.of[kind] += Clock::now() - begin;
}

void Pipeline::Impl::run_actions(Busy& busy) {
  const auto& actions = schedule.actions[rank];
  for (size_t i = 0; i < actions.size();) {
    const Action& a = actions[i];
    current = a;
    position = i;
    try {
      if (a.is_compute()) {
        run_compute(a, busy);
        ++i;
      } else {
        post(a);  // a batch: sends are posted at once, receives when needed
        position = ++i;
      }
    } catch (const std::exception& e) {  // the stages may throw anything
      // The pipeline's own errors name their microbatch already; others
      // (a stage's, a collective's inside it) are named, keeping their kind.
      const Error* typed = as_commgrad_error(e);
      if (typed != nullptr && typed->site().op == kOp) throw;
      const auto* error = dynamic_cast<const c10::Error*>(&e);
      COMMGRAD_THROW(typed ? typed->kind() : ErrorKind::kInvalidArgument, error_site(kOp, group), where(current),
                     " failed: ", error ? error->what_without_backtrace() : e.what());
    }
  }
}

void Pipeline::Impl::finish_communication() {
  while (!receives.empty()) {  // none is left by a valid schedule; taken so no message stays behind
    receive(receives.front());
    receives.pop_front();
  }
  try {
    for (auto& s : sends) s.first.wait();
  } catch (const c10::Error& e) {
    const Error* typed = as_commgrad_error(e);
    COMMGRAD_THROW(typed ? typed->kind() : ErrorKind::kPeerFailed, error_site(kOp, group),
                   "waiting for this step's sends failed: ", e.what_without_backtrace());
  }
}

// A failed step: the neighbours hear of it, and nothing of it is kept.
void Pipeline::Impl::abandon_step(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  tell_neighbours(error ? error->what_without_backtrace() : e.what(), -1);
  slots.clear();
  sends.clear();
  receives.clear();
}

// Every rank reports the loss: the last stage's rank broadcasts it.
PipelineStepResult Pipeline::Impl::report(const Busy& busy, Clock::time_point start) {
  const auto end = Clock::now();
  const int mbs = schedule.microbatches;
  auto all = at::from_blob(losses.data(), {mbs}, at::kDouble).clone();
  if (group.size() > 1) {
    all = ops::raw::broadcast(all, ops::BroadcastOptions().src(schedule.rank_of(last_stage())), group).wait();
  }
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  PipelineStepResult result;
  result.forward_seconds = seconds(busy.of[0]);
  result.backward_seconds = seconds(busy.of[1]);
  result.backward_weight_seconds = seconds(busy.of[2]);
  result.compute_seconds = result.forward_seconds + result.backward_seconds + result.backward_weight_seconds;
  result.step_seconds = seconds(end - start);
  result.microbatch_losses.assign(all.data_ptr<double>(), all.data_ptr<double>() + mbs);
  for (double l : result.microbatch_losses) result.loss += l / mbs;
  return result;
}

PipelineStepResult Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) {
  auto& m = *impl_;
  m.start_step(inputs, targets);
  const auto start = Impl::Clock::now();
  Impl::Busy busy;
  try {
    if (m.rank == m.schedule.rank_of(0)) m.check_batch(inputs, "inputs");
    if (m.rank == m.schedule.rank_of(m.last_stage())) m.check_batch(targets, "targets");
    m.run_actions(busy);
    m.finish_communication();
  } catch (const std::exception& e) {
    m.abandon_step(e);
    throw;
  }
  m.sends.clear();
  m.slots.clear();
  return m.report(busy, start);
}

}  // namespace commgrad::pp
