// The context of one raw call.

#include "detail/call.h"

#include "detail/pending.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/flight_recorder.h"

#include <memory>

namespace commgrad::ops::detail {

Call::Call(const char* op_name, const Group& g) : op(op_name), group(raw::resolve_group(g)) {
  check_member(op, group);
  rank = group.rank();
  size = group.size();
}

void Call::start(const at::Tensor& x) {
  sequence = group.next_sequence();
  record = commgrad::detail::note_collective_started(op, sequence, group.state(), x);
}

raw::Pending Call::ready(at::Tensor result) const {
  auto s = std::make_shared<PendingState>();
  s->op = op;
  s->group = group;
  s->sequence = sequence;
  s->record = record;
  s->result = std::move(result);
  s->done = true;
  commgrad::detail::note_collective_finished(record);
  return raw::Pending(std::move(s));
}

raw::Pending Call::pending(std::vector<commgrad::detail::WorkPtr> works, std::function<at::Tensor()> finish) const {
  auto s = std::make_shared<PendingState>();
  s->op = op;
  s->group = group;
  s->sequence = sequence;
  s->record = record;
  s->works = std::move(works);
  commgrad::detail::note_collective_posted(record);
  s->finish = std::move(finish);
  return raw::Pending(std::move(s));
}

}  // namespace commgrad::ops::detail
