#include "harness/spawn_ranks.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <condition_variable>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <thread>
#include <vector>

namespace commgrad::testing {

void spawn_ranks(int world_size, const std::function<void(Group&)>& body, const SpawnOptions& options) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::condition_variable done_cv;
  std::vector<bool> done(world_size, false);
  std::vector<bool> body_done(world_size, false);
  int bodies_done = 0;
  std::vector<std::string> errors(world_size);
  std::vector<std::thread> threads;
  // COMMGRAD_TEST_BACKEND runs every thread-harness test over another
  // transport (e.g. shm), whatever the test asked for.
  const char* forced = std::getenv("COMMGRAD_TEST_BACKEND");
  const std::string backend = forced != nullptr && *forced != '\0' ? forced : options.backend();
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      SCOPED_TRACE(::testing::Message() << "rank " << r << "/" << world_size);
      Group world;
      try {
        world = make_world_group(InitOptions()
                                     .store(store)
                                     .rank(r)
                                     .world_size(world_size)
                                     .backend(backend)
                                     .timeout(options.timeout())
                                     .intra_op_threads(0));
        ScopedWorld scope(world);
        body(world);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[r] = e.what();
      }
      // Keep this rank's transport until every rank is done (Gloo's test
      // harness does the same): a rank that tears its group down early makes
      // a peer still connecting fail with "Connection closed by peer" or hang.
      std::unique_lock<std::mutex> lock(mutex);
      body_done[r] = true;
      ++bodies_done;
      done_cv.notify_all();
      done_cv.wait(lock, [&] { return bodies_done == world_size; });
      lock.unlock();
      world = Group();
      lock.lock();
      done[r] = true;
      done_cv.notify_all();
    });
  }
  // A rank stuck past every timeout would hang the suite: abort instead,
  // naming the ranks that never finished.
  const auto deadline = std::chrono::steady_clock::now() + options.timeout() + std::chrono::seconds(15);
  {
    std::unique_lock<std::mutex> lock(mutex);
    const bool finished = done_cv.wait_until(lock, deadline, [&] {
      for (bool d : done) {
        if (!d) return false;
      }
      return true;
    });
    if (!finished) {
      std::cerr << "spawn_ranks: ranks did not finish in time:";
      for (int r = 0; r < world_size; ++r) {
        if (!body_done[r]) std::cerr << " " << r;
      }
      std::cerr << std::endl;
      std::abort();
    }
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world_size; ++r) {
    if (!errors[r].empty()) ADD_FAILURE() << "rank " << r << "/" << world_size << " threw: " << errors[r];
  }
}

}  // namespace commgrad::testing
