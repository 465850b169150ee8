// The wire between pipeline stages (Pipeline::Impl's messages).
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
#include "detail/pipeline_impl.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/error.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace commgrad::pp {

using namespace detail::pipeline;

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
  const auto text =
      at::from_blob(const_cast<char*>(what.data()), {static_cast<int64_t>(what.size())}, at::kByte).clone();
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
    COMMGRAD_THROW(ErrorKind::kPeerFailed, error_site(kOp, group), where(a), ": pipeline rank ", peer, " (",
                   activation ? "previous" : "next", " stage ", activation ? a.stage - 1 : a.stage + 1,
                   ") failed: ", what);
  }
  COMMGRAD_CHECK_AS(ErrorKind::kMismatch,
                    h[0] == kMagic && h[1] == a.stage && h[2] == a.microbatch && h[3] == (activation ? 0 : 1) &&
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

}  // namespace commgrad::pp
