// ShmWork: the Work of a ShmProcessGroup call, completed by the executor
// job that runs it (completing), with its Future made on first request.

#include "detail/shm_work.h"

#include "detail/shm_executor.h"

namespace commgrad::backend::detail {

void ShmWork::complete(const std::exception_ptr& error) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
    done_ = true;
    future = future_;
  }
  if (future) settle(*future);
  finish(error);
}

int ShmWork::sourceRank() const {
  const int rank = source_rank_.load();
  if (rank < 0) return c10d::Work::sourceRank();  // not a recv: c10d's error
  return rank;
}

// A caller that waits before the worker thread has started the job runs
// it itself (see Executor::run_until); otherwise the worker must get to it.
// A Work that is not completed belongs to a live group: the group's
// destructor drains its queue.
// A wait with a timeout of its own never runs the job here (the job could
// take as long as the group's timeout): the worker runs it and c10d's wait
// gives up after `timeout`, as it does for Gloo.
bool ShmWork::wait(std::chrono::milliseconds timeout) {
  if (executor_ != nullptr && !c10d::Work::isCompleted()) {
    if (timeout != kNoTimeout || !executor_->run_until(ticket_)) executor_->wake();
  }
  return c10d::Work::wait(timeout);
}

// A caller that polls instead of waiting gets the job started.
bool ShmWork::isCompleted() {
  const bool done = c10d::Work::isCompleted();
  if (!done && executor_ != nullptr) executor_->wake();
  return done;
}

c10::intrusive_ptr<c10::ivalue::Future> ShmWork::getFuture() {
  if (executor_ != nullptr && !c10d::Work::isCompleted()) executor_->wake();  // callbacks need progress
  c10::intrusive_ptr<c10::ivalue::Future> future;
  bool settle_now = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      settle_now = done_;
    }
    future = future_;
  }
  if (settle_now) settle(*future);
  return future;
}

void ShmWork::settle(c10::ivalue::Future& future) {
  if (error_) {
    future.setError(error_);
  } else {
    future.markCompleted(c10::IValue(result()));
  }
}

std::function<void()> completing(c10::intrusive_ptr<ShmWork> work, Comm* comm, const char* op,
                                 std::chrono::milliseconds limit, std::function<void(Comm&, const Call&)> run) {
  return [work = std::move(work), comm, op, limit, run = std::move(run)]() mutable {
    work->complete(run_call(*comm, op, limit, run));
  };
}

}  // namespace commgrad::backend::detail
