#pragma once
// The Work a ShmProcessGroup call returns, and the executor job that
// completes it (completing).

#include "commgrad/detail/torch_compat.h"

#include "detail/shm_comm.h"
#include "detail/shm_executor.h"

#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <time.h>
#include <vector>

namespace commgrad::backend::detail {

class Executor;

/// A Work completed by an executor job. Its Future (as ProcessGroupGloo
/// has) is made on first request: most callers only wait(), and completing
/// a Future costs more than a small all-reduce.
class ShmWork : public c10d::Work {
 public:
  ShmWork(int rank, c10d::OpType type, c10::ArrayRef<at::Tensor> outputs)
      : c10d::Work(rank, type), outputs_(outputs.begin(), outputs.end()) {}
  /// A Work born completed with `error` (or the outputs when null).
  ShmWork(int rank, c10d::OpType type, c10::ArrayRef<at::Tensor> outputs, std::exception_ptr error)
      : c10d::Work(rank, type), outputs_(outputs.begin(), outputs.end()), error_(error), done_(true) {
    completed_ = true;
    exception_ = std::move(error);
  }

  /// Marks the Work (and its Future, if one was asked for) done with `error`, or with the outputs when null.
  void complete(const std::exception_ptr& error);

  std::vector<at::Tensor> result() override { return {outputs_.begin(), outputs_.end()}; }

  /// The rank a recv received from (set by the job before it completes).
  void set_source_rank(int rank) { source_rank_.store(rank); }
  int sourceRank() const override;

  /// The job behind this Work sits in `executor`'s queue under `ticket`.
  void queued_in(Executor* executor, uint64_t ticket) {
    executor_ = executor;
    ticket_ = ticket;
  }

  bool wait(std::chrono::milliseconds timeout) override;
  bool isCompleted() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void settle(c10::ivalue::Future& future);

  // Most calls have one output: held without a heap allocation, which a
  // 4 KiB collective would notice.
  c10::SmallVector<at::Tensor, 1> outputs_;
  Executor* executor_ = nullptr;
  uint64_t ticket_ = 0;
  std::exception_ptr error_;  // guarded by mutex_ until done_
  bool done_ = false;
  std::atomic<int> source_rank_{-1};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// steady_clock's now() to the kernel's tick (a few ms): enough for a
/// deadline, and it reads no clock source (the precise now() is about 20 ns
/// of a 4 KiB all-reduce's 500 on one rank here).
inline std::chrono::steady_clock::time_point coarse_now() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);  // steady_clock is CLOCK_MONOTONIC
  return std::chrono::steady_clock::time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
}

/// Runs `run(comm, call)` under a Call for `op` whose deadline starts now;
/// returns what it threw.
template <class Run>
std::exception_ptr run_call(Comm& comm, const char* op, std::chrono::milliseconds limit, Run& run) noexcept {
  Call call;
  call.op = op;
  call.timeout = limit;
  call.deadline = coarse_now() + limit;
  try {
    run(comm, call);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

/// An executor job: runs `run` under a Call for `op` whose deadline starts
/// when the job does, and completes `work` with the outcome.
std::function<void()> completing(c10::intrusive_ptr<ShmWork> work, Comm* comm, const char* op,
                                 std::chrono::milliseconds limit, std::function<void(Comm&, const Call&)> run);

/// Runs `run` (see run_call) on this thread when `inline_ok` and nothing is
/// queued or running on `executor`, and returns a Work born completed: no
/// job or closure on the heap, which a small collective would notice.
/// Otherwise queues it as a job that completes the Work it returns.
template <class Run>
c10::intrusive_ptr<ShmWork> run_or_queue(Executor& executor, bool inline_ok, Comm& comm, const char* op,
                                         std::chrono::milliseconds limit, int rank, c10d::OpType type,
                                         c10::ArrayRef<at::Tensor> outputs, Run&& run) {
  if (inline_ok) {
    std::exception_ptr error;
    if (executor.run_if_idle([&] { error = run_call(comm, op, limit, run); })) {
      return c10::make_intrusive<ShmWork>(rank, type, outputs, std::move(error));
    }
  }
  auto work = c10::make_intrusive<ShmWork>(rank, type, outputs);
  const uint64_t ticket = executor.submit(
      completing(work, &comm, op, limit, std::function<void(Comm&, const Call&)>(std::forward<Run>(run))));
  work->queued_in(&executor, ticket);
  return work;
}

}  // namespace commgrad::backend::detail
