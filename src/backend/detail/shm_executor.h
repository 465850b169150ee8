#pragma once
// The executor behind every ShmProcessGroup call: jobs run in submission
// order, on the caller's thread when nothing is queued or running and the
// caller asks for it (run_if_idle), otherwise on a worker thread started on
// first use (submit).
// Whoever waits for a queued job that has not started runs it (and the
// queued jobs before it) on its own thread (run_until): a caller that waits
// at once then pays no thread handoff (two wake-ups, 100 us and more on a
// loaded VM).
//
// Eager or lazy. An eager executor wakes its worker at every submission, so
// a job runs while its caller computes (overlap). That only pays when the
// worker has a core to itself: on a machine whose cores the ranks already
// fill, waking the worker costs each collective a context switch in the
// middle of its lockstep with the peers (2 ranks on 2 cores, 1 MiB
// all-reduce: about 200 us instead of 150). A lazy executor leaves a lone
// queued job to its waiter; the worker starts it when a second job is
// queued behind it, when someone polls or asks for a Future (wake), or at
// the latest `lazy_start` after submission, so that every job makes
// progress even if nobody waits for it. Internal to commgrad_backend.
//
// A count of the jobs queued or running (pending_) lets run_if_idle claim
// an idle executor with one compare-and-swap instead of two rounds of the
// mutex: a small collective runs inline on every call.

#include <algorithm>
#include <atomic>
#include <chrono>
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
  using Clock = std::chrono::steady_clock;

  explicit Executor(bool eager = true, Clock::duration lazy_start = std::chrono::milliseconds(10))
      : eager_(eager), lazy_start_(lazy_start) {}
  ~Executor() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  /// Queues `job`, which must not throw. Returns its ticket for run_until().
  uint64_t submit(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t ticket = ++last_ticket_;
    const Clock::time_point now = Clock::now();
    pending_.fetch_add(1, std::memory_order_relaxed);  // a job inline finishes by fetch_sub, then takes the lock
    queue_.push_back({ticket, eager_ ? now : now + lazy_start_, std::move(job)});
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    // Lazy: a job queued behind another means the caller moved on without
    // waiting, so the worker may start them all.
    if (eager_ || queue_.size() > 1 || running_locked()) release_all_locked(now);
    return ticket;
  }

  /// Runs `job` now, on this thread, when nothing is queued or running.
  /// `job` must not throw. False when it did not run.
  template <class Job>
  bool run_if_idle(Job&& job) {
    uint64_t idle = 0;  // nothing queued, nothing running
    if (!pending_.compare_exchange_strong(idle, 1, std::memory_order_acquire, std::memory_order_relaxed)) {
      return false;
    }
    job();
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) {
      // Jobs were queued behind this one meanwhile: the worker may start them.
      std::lock_guard<std::mutex> lock(mutex_);
      cv_.notify_all();
    }
    return true;
  }

  /// Runs the queued jobs up to and including `ticket` on this thread, in
  /// order, while nothing else runs. True when the job with `ticket` ran
  /// here; false when it is running elsewhere, done, or behind a running job.
  bool run_until(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!running_locked() && !queue_.empty() && queue_.front().ticket <= ticket) {
      const bool mine = queue_.front().ticket == ticket;
      auto job = std::move(queue_.front().job);
      queue_.pop_front();
      run_locked(job, lock);
      if (mine) return true;
    }
    return false;
  }

  /// Lets the worker start every queued job now (a lazy executor's progress
  /// for callers that poll instead of waiting).
  void wake() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!queue_.empty()) release_all_locked(Clock::now());
  }

 private:
  // Lets the worker start every queued job from `now` on (mutex_ held).
  void release_all_locked(Clock::time_point now) {
    for (Queued& q : queue_) q.start = std::min(q.start, now);
    cv_.notify_all();
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto ready = [&] { return (stop_ && queue_.empty()) || (!running_locked() && !queue_.empty()); };
    while (true) {
      if (eager_) {
        cv_.wait(lock, ready);
      } else if (!cv_.wait_for(lock, lazy_start_, ready)) {
        continue;  // a lazy worker looks at least every lazy_start, as nobody wakes it for a lone job
      }
      if (queue_.empty()) return;  // stopping, and drained
      const Clock::time_point start = queue_.front().start;
      if (!stop_ && Clock::now() < start) {
        cv_.wait_until(lock, start);  // its waiter may take it meanwhile
        continue;
      }
      auto job = std::move(queue_.front().job);
      queue_.pop_front();
      run_locked(job, lock);
    }
  }

  // A job is running, inline or here (mutex_ held: the queue does not move).
  // A popped job stays in pending_ until it returns.
  bool running_locked() const { return pending_.load(std::memory_order_acquire) > queue_.size(); }

  // Runs `job`, just popped from the queue, with the lock released.
  void run_locked(std::function<void()>& job, std::unique_lock<std::mutex>& lock) {
    lock.unlock();
    job();
    job = nullptr;  // its captures (the Work, tensors) are released on this thread
    lock.lock();
    pending_.fetch_sub(1, std::memory_order_release);
    if (!queue_.empty()) cv_.notify_all();
  }

  struct Queued {
    uint64_t ticket;
    Clock::time_point start;  // when the worker may start it
    std::function<void()> job;
  };

  const bool eager_;
  const Clock::duration lazy_start_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  uint64_t last_ticket_ = 0;
  // Jobs queued or running (inline included); changed under mutex_, but for
  // run_if_idle's compare-and-swap on an idle executor and its decrement.
  std::atomic<uint64_t> pending_{0};
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace commgrad::backend::detail
