// The context of one raw call.

#include "detail/call.h"

#include "detail/pending.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/terminate_handler.h"

#include <memory>

namespace commgrad::ops::detail {

Call::Call(const char* op_name, const Group& g) : op(op_name), group(raw::resolve_group(g)) {
  check_member(op, group);
  rank = group.rank();
  size = group.size();
}

void Call::start() {
  sequence = group.next_sequence();
  commgrad::detail::note_collective_started(op, sequence, group.state());
}

raw::Pending Call::ready(at::Tensor result) const {
  auto s = std::make_shared<PendingState>();
  s->op = op;
  s->group = group;
  s->sequence = sequence;
  s->result = std::move(result);
  s->done = true;
  commgrad::detail::note_collective_finished(sequence, group.state());
  return raw::Pending(std::move(s));
}

raw::Pending Call::pending(std::vector<commgrad::detail::WorkPtr> works, std::function<at::Tensor()> finish) const {
  auto s = std::make_shared<PendingState>();
  s->op = op;
  s->group = group;
  s->sequence = sequence;
  s->works = std::move(works);
  s->finish = std::move(finish);
  return raw::Pending(std::move(s));
}

}  // namespace commgrad::ops::detail
