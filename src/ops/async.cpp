// AsyncTensor: a differentiable collective in flight. The *_async ops
// themselves are written out next to their synchronous forms in
// collectives.cpp, with which they share each op's finishing step.

#include "commgrad/ops/async.h"

#include <c10/util/Exception.h>

namespace commgrad::ops {

struct AsyncTensor::State {
  raw::Pending pending;
  Finish finish;
  at::Tensor result;
  bool done = false;
};

AsyncTensor::AsyncTensor(raw::Pending pending, Finish finish) : state_(std::make_shared<State>()) {
  state_->pending = std::move(pending);
  state_->finish = std::move(finish);
}

bool AsyncTensor::is_completed() const {
  TORCH_CHECK(state_, "[commgrad] is_completed() on an empty AsyncTensor");
  return state_->done || state_->pending.is_completed();
}

at::Tensor AsyncTensor::wait() {
  TORCH_CHECK(state_, "[commgrad] wait() on an empty AsyncTensor");
  if (!state_->done) {
    state_->result = state_->finish ? state_->finish(state_->pending) : state_->pending.wait();
    state_->finish = nullptr;
    state_->done = true;
  }
  return state_->result;
}

}  // namespace commgrad::ops
