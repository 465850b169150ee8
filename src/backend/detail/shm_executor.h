#pragma once
// The executor behind every ShmProcessGroup call: jobs run in submission
// order, on the caller's thread when nothing is queued or running (and the
// caller allows it), otherwise on a worker thread started on first use.
// Internal to commgrad_backend.

#include <condition_variable>
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
  /// or running; otherwise queues it. `job` must not throw.
  void submit(std::function<void()> job, bool inline_ok) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (inline_ok && !busy_ && queue_.empty()) {
      busy_ = true;
      lock.unlock();
      job();
      lock.lock();
      busy_ = false;
      if (!queue_.empty()) cv_.notify_all();
      return;
    }
    queue_.push_back(std::move(job));
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    cv_.notify_all();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      cv_.wait(lock, [&] { return (stop_ && queue_.empty()) || (!busy_ && !queue_.empty()); });
      if (queue_.empty()) return;  // stopping, and drained
      auto job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      job();
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;  // a job is running (on the worker or inline)
  bool stop_ = false;
  std::thread thread_;
};


}  // namespace commgrad::backend::detail
