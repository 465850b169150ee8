// CoalescedWork: one handle for several collectives (see the header). Its
// Future completes from the callbacks of the parts' Futures: the last part
// to finish completes it, the first to fail fails it.

#include "coalesced_work.h"

#include <atomic>
#include <memory>
#include <mutex>

namespace commgrad::python {

CoalescedWork::CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::vector<at::Tensor> outputs,
                             c10d::OpType type)
    : c10d::Work(-1, type), works_(std::move(works)), outputs_(std::move(outputs)) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  if (works_.empty()) {
    future_->markCompleted(c10::IValue(outputs_));
    return;
  }
  struct Pending {
    std::mutex mutex;
    size_t left;
    bool settled = false;
  };
  auto pending = std::make_shared<Pending>();
  pending->left = works_.size();
  for (auto& w : works_) {
    w->getFuture()->addCallback([pending, future = future_, outputs = outputs_](c10::ivalue::Future& part) {
      std::lock_guard<std::mutex> lock(pending->mutex);
      if (pending->settled) return;
      if (part.hasError()) {
        pending->settled = true;
        future->setError(part.exception_ptr());
      } else if (--pending->left == 0) {
        pending->settled = true;
        future->markCompleted(c10::IValue(outputs));
      }
    });
  }
}

bool CoalescedWork::isCompleted() {
  for (auto& w : works_) {
    if (!w->isCompleted()) return false;
  }
  return true;
}

bool CoalescedWork::isSuccess() const {
  for (const auto& w : works_) {
    if (w->exception()) return false;
  }
  return true;
}

std::exception_ptr CoalescedWork::exception() const {
  for (const auto& w : works_) {
    if (auto e = w->exception()) return e;
  }
  return nullptr;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  for (auto& w : works_) w->wait(timeout);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() { return future_; }

}  // namespace commgrad::python
