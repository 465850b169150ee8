#pragma once
// The Work a ShmProcessGroup call returns, and the executor job that
// completes it (completing).

#include "commgrad/detail/torch_compat.h"

#include "detail/shm_comm.h"

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

namespace commgrad::backend::detail {

class Executor;

/// A Work completed by an executor job. Its Future (as ProcessGroupGloo
/// has) is made on first request: most callers only wait(), and completing
/// a Future costs more than a small all-reduce.
class ShmWork : public c10d::Work {
 public:
  ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type), outputs_(std::move(outputs)) {}

  /// Marks the Work (and its Future, if one was asked for) done with `error`, or with the outputs when null.
  void complete(const std::exception_ptr& error);

  std::vector<at::Tensor> result() override { return outputs_; }

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

  std::vector<at::Tensor> outputs_;
  Executor* executor_ = nullptr;
  uint64_t ticket_ = 0;
  std::exception_ptr error_;  // guarded by mutex_ until done_
  bool done_ = false;
  std::atomic<int> source_rank_{-1};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// An executor job: runs `run` under a Call for `op` whose deadline starts
/// when the job does, and completes `work` with the outcome.
std::function<void()> completing(c10::intrusive_ptr<ShmWork> work, Comm* comm, const char* op,
                                 std::chrono::milliseconds limit, std::function<void(Comm&, const Call&)> run);

}  // namespace commgrad::backend::detail
