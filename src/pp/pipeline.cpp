// Pipeline: one rank's part of a schedule, executed.
//
// State per (stage, microbatch): the stage's input (a leaf that requires
// grad when it is an activation, so backward stops there and its gradient
// is what goes to the previous stage), its output, and on the last stage
// the loss, scaled by 1/m so that the gradients are those of the mean loss
// over the microbatches. Everything of a microbatch on a stage is dropped
// after its backward: only the microbatches in flight hold activations.
//
// Wire. Each message is a header (int64[12]: magic, stage and microbatch it
// is for, kind, dtype, rank, sizes) followed by the data, on tag 2 s + kind
// of the receiving stage s (kind 0 activation, 1 gradient), so messages of
// different stages or directions between the same two ranks never match
// each other, and within one the order of microbatches is the same on both
// sides. The receiver checks the header against what its schedule expects.
// A batch's sends are posted at once (and waited for at the end of the
// step); its receives are taken when a computation needs them, one message
// after the other in the schedule's order (a transport may deliver one
// peer's messages in order whatever their tags, as shm does). So in the
// interleaved steady state, whose batches carry the receives of a forward
// and of a backward, the forward does not wait for the backward's gradient.
// Sends never block, so waiting for less than the whole batch cannot
// deadlock a schedule that runs with batches.
//
// Errors. A rank whose step fails (a bad batch, a stage that throws, a
// peer that died) tells each neighbour it still had something to send: an
// error header (kind 2) and the message, on the tag of the next message it
// would have sent there, which is the next one that neighbour receives from
// it. The neighbour throws naming the rank that failed and passes the
// message on to its other neighbours, so every rank of the pipeline ends at
// once instead of at its timeout.
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

#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/weight_gradients.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <utility>

namespace commgrad::pp {
namespace {

constexpr const char* kOp = "Pipeline";
constexpr int64_t kMagic = 0x636770;  // "cgp"
constexpr int64_t kMaxDims = 6;
constexpr int64_t kHeaderSize = 6 + kMaxDims;
constexpr int64_t kErrorKind = 2;  // header kind of an error message (0 activation, 1 gradient)

using Key = std::pair<int, int>;  // stage, microbatch

bool is_activation(ActionKind kind) { return kind == ActionKind::kSendActivation || kind == ActionKind::kRecvActivation; }

// The stage that receives what `a` sends or receives.
int receiving_stage(const Action& a) {
  switch (a.kind) {
    case ActionKind::kSendActivation: return a.stage + 1;
    case ActionKind::kSendGradient: return a.stage - 1;
    default: return a.stage;
  }
}

int tag_of(const Action& a) { return 2 * receiving_stage(a) + (is_activation(a.kind) ? 0 : 1); }

}  // namespace

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
  std::map<int, bool> deferring;  // split backward: stage -> its forwards deferred weight gradients
  Action current{ActionKind::kForward, 0, 0};  // what runs now (for errors)

  struct Slot {
    at::Tensor input, output, loss, grad_output, grad_input;
    tp::WeightGradients weights;  // split backward: deferred by the forward, computed by W
  };
  std::map<Key, Slot> slots;
  std::vector<std::pair<ops::raw::Pending, at::Tensor>> sends;  // kept alive until waited for
  std::deque<Action> receives;  // posted by a batch, taken when a computation needs them
  size_t position = 0;          // this rank's first action not yet started (or posted)
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
  at::Tensor microbatch_of(const at::Tensor& batch, int mb) const {
    return batch.chunk(schedule.microbatches, 0)[mb];
  }
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

Pipeline::Pipeline(std::vector<StageFunction> stages, LossFunction loss, PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.group = ops::raw::resolve_group(options.group());
  m.rank = m.group.rank();
  COMMGRAD_CHECK(static_cast<bool>(loss), kOp, m.group, "the loss function is empty");
  m.schedule = make_schedule(options.schedule(), m.group.size(), options.microbatches(), options.stages_per_rank());
  COMMGRAD_CHECK(static_cast<int>(stages.size()) == options.stages_per_rank(), kOp, m.group, "the ",
                 options.schedule(), " schedule puts ", options.stages_per_rank(), " stage(s) on each rank, but this rank got ",
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
    COMMGRAD_CHECK(slot.grad_output.sizes() == slot.output.sizes(), kOp, group, where(a), ": the gradient of the output is ",
                   tensor_name(slot.grad_output), ", but the output is ", tensor_name(slot.output));
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

void Pipeline::Impl::post_send(const Action& a) {
  current = a;
  const auto& slot = slots.at({a.stage, a.microbatch});
  const bool activation = a.kind == ActionKind::kSendActivation;
  const at::Tensor data = (activation ? slot.output : slot.grad_input).detach().contiguous();
  COMMGRAD_CHECK(data.dim() <= kMaxDims, kOp, group, where(a), ": ", tensor_name(data), " has more than ", kMaxDims,
                 " dims");
  send_header(data, activation ? 0 : 1, a);
  const auto options = ops::SendOptions(schedule.rank_of(receiving_stage(a))).tag(tag_of(a));
  sends.emplace_back(ops::raw::send(data, options, group), data);
  if (!activation) slots.at({a.stage, a.microbatch}).grad_input = at::Tensor();  // sent: no longer needed here
}

// The header of what send action `a` sends (`data`: its dtype and shape).
void Pipeline::Impl::send_header(const at::Tensor& data, int64_t kind, const Action& a) {
  auto header = at::zeros({kHeaderSize}, at::kLong);
  auto* h = header.data_ptr<int64_t>();
  h[0] = kMagic;
  h[1] = receiving_stage(a);
  h[2] = a.microbatch;
  h[3] = kind;
  h[4] = static_cast<int64_t>(data.scalar_type());
  h[5] = data.dim();
  for (int64_t d = 0; d < data.dim(); ++d) h[6 + d] = data.size(d);
  const auto options = ops::SendOptions(schedule.rank_of(receiving_stage(a))).tag(tag_of(a));
  (kind == kErrorKind ? error_sends : sends).emplace_back(ops::raw::send(header, options, group), header);
}

void Pipeline::Impl::tell_neighbours(const std::string& what, int except) {
  if (neighbours_told) return;
  neighbours_told = true;
  const auto& actions = schedule.actions[rank];
  std::vector<int> told;
  const auto text = at::from_blob(const_cast<char*>(what.data()), {static_cast<int64_t>(what.size())}, at::kByte).clone();
  for (size_t i = position; i < actions.size(); ++i) {
    const Action& a = actions[i];
    if (a.kind != ActionKind::kSendActivation && a.kind != ActionKind::kSendGradient) continue;
    const int peer = schedule.rank_of(receiving_stage(a));
    if (peer == except || std::find(told.begin(), told.end(), peer) != told.end()) continue;
    told.push_back(peer);
    try {
      send_header(text, kErrorKind, a);
      error_sends.emplace_back(ops::raw::send(text, ops::SendOptions(peer).tag(tag_of(a)), group), text);
    } catch (const std::exception&) {
      // The neighbour's transport is gone too; it learns of the failure by itself.
    }
  }
}

void Pipeline::Impl::post(const Action& a) {
  if (a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGradient) {
    post_send(a);
  } else {
    receives.push_back(a);
  }
}

void Pipeline::Impl::receive_for(const Action& compute) {
  // The receive this computation needs, if any: taken with every receive
  // before it, in the schedule's order.
  ActionKind kind = ActionKind::kRecvActivation;
  if (compute.kind == ActionKind::kForward) {
    if (compute.stage == 0 || schedule.rank_of(compute.stage - 1) == rank) return;
  } else if (compute.kind == ActionKind::kBackward) {
    if (compute.stage == last_stage() || schedule.rank_of(compute.stage + 1) == rank) return;
    kind = ActionKind::kRecvGradient;
  } else {
    return;
  }
  const Action want{kind, compute.stage, compute.microbatch};
  while (!receives.empty()) {
    const Action a = receives.front();
    receives.pop_front();
    receive(a);
    if (a.kind == want.kind && a.stage == want.stage && a.microbatch == want.microbatch) return;
  }
}

void Pipeline::Impl::receive(const Action& a) {
  current = a;
  const bool activation = is_activation(a.kind);
  const int peer = schedule.rank_of(activation ? a.stage - 1 : a.stage + 1);
  const auto options = ops::RecvOptions(peer).tag(tag_of(a));
  const auto header = ops::raw::recv({kHeaderSize}, ops::RecvOptions(options).dtype(at::kLong), group).wait();
  const auto* h = header.data_ptr<int64_t>();
  if (h[0] == kMagic && h[3] == kErrorKind && h[5] == 1 && h[4] == static_cast<int64_t>(at::kByte)) {
    const auto text = ops::raw::recv({h[6]}, ops::RecvOptions(options).dtype(at::kByte), group).wait();
    const std::string what(static_cast<const char*>(text.data_ptr()), static_cast<size_t>(text.numel()));
    tell_neighbours(what, peer);
    COMMGRAD_CHECK(false, kOp, group, where(a), ": pipeline rank ", peer, " (", activation ? "previous" : "next",
                   " stage ", activation ? a.stage - 1 : a.stage + 1, ") failed: ", what);
  }
  COMMGRAD_CHECK(h[0] == kMagic && h[1] == a.stage && h[2] == a.microbatch && h[3] == (activation ? 0 : 1) &&
                     h[5] >= 0 && h[5] <= kMaxDims,
                 kOp, group, where(a), ": expected the ", activation ? "activation" : "gradient", " of stage ",
                 a.stage, " microbatch ", a.microbatch, ", but the header received says stage ", h[1],
                 " microbatch ", h[2], " kind ", h[3], " (magic ", h[0], ")");
  const std::vector<int64_t> sizes(h + 6, h + 6 + h[5]);
  auto t = ops::raw::recv(sizes, ops::RecvOptions(options).dtype(static_cast<at::ScalarType>(h[4])), group).wait();
  auto& slot = slots[{a.stage, a.microbatch}];
  if (activation) {
    slot.input = t.requires_grad_(t.is_floating_point());
  } else {
    slot.grad_output = t;
  }
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
  error_sends.erase(std::remove_if(error_sends.begin(), error_sends.end(),
                                   [](const auto& s) { return s.first.is_completed(); }),
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
