// CoalescedWork: one handle for several collectives (see the header). Its
// Future completes from the callbacks of the parts' Futures: the last part
// to finish completes it, the first to fail fails it.

#include "coalesced_work.h"

#include <c10/util/Exception.h>

#include <algorithm>
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

// One deadline for all the parts: wait(2 s) gives up after 2 s in all.
bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  for (auto& w : works_) {
    if (timeout == kNoTimeout) {
      w->wait();
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    TORCH_CHECK(left.count() > 0 || w->isCompleted(), "[commgrad] Operation timed out!");
    w->wait(std::max(left, std::chrono::milliseconds(1)));
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() { return future_; }

}  // namespace commgrad::python
