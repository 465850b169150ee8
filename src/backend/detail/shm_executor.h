#pragma once
// The executor behind every ShmProcessGroup call: jobs run in submission
// order, on the caller's thread when nothing is queued or running (and the
// caller allows it), otherwise on a worker thread started on first use.
// A queued job that is next in line and not yet started can also be taken
// back by whoever waits for it (run_if_next): a caller that waits at once
// then pays no thread handoff (two wake-ups, 100 us and more on a loaded
// VM), and one that computes first still gets its collective run meanwhile.
// Internal to commgrad_backend.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace commgrad::backend::detail {

/// Runs jobs in submission order, on the caller's thread when possible.
class Executor {
 public:
  Executor() = default;
  ~Executor() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  /// Runs `job` now, on this thread, when `inline_ok` and nothing is queued
  /// or running; otherwise queues it. `job` must not throw. Returns the
  /// queued job's ticket for run_if_next(), or 0 when it already ran.
  uint64_t submit(std::function<void()> job, bool inline_ok) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (inline_ok && !busy_ && queue_.empty()) {
      run_locked(job, lock);
      return 0;
    }
    const uint64_t ticket = ++last_ticket_;
    queue_.push_back({ticket, std::move(job)});
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    cv_.notify_all();
    return ticket;
  }

  /// Runs the job with `ticket` on this thread if it is next in line and
  /// nothing is running; false when it is not (running, done, or behind others).
  bool run_if_next(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (busy_ || queue_.empty() || queue_.front().ticket != ticket) return false;
    auto job = std::move(queue_.front().job);
    queue_.pop_front();
    run_locked(job, lock);
    return true;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      cv_.wait(lock, [&] { return (stop_ && queue_.empty()) || (!busy_ && !queue_.empty()); });
      if (queue_.empty()) return;  // stopping, and drained
      auto job = std::move(queue_.front().job);
      queue_.pop_front();
      run_locked(job, lock);
    }
  }

  // Runs `job` with the lock released, marked busy meanwhile.
  void run_locked(std::function<void()>& job, std::unique_lock<std::mutex>& lock) {
    busy_ = true;
    lock.unlock();
    job();
    job = nullptr;  // its captures (the Work, tensors) are released on this thread
    lock.lock();
    busy_ = false;
    if (!queue_.empty()) cv_.notify_all();
  }

  struct Queued {
    uint64_t ticket;
    std::function<void()> job;
  };

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  uint64_t last_ticket_ = 0;
  bool busy_ = false;  // a job is running (on the worker or inline)
  bool stop_ = false;
  std::thread thread_;
};


}  // namespace commgrad::backend::detail
