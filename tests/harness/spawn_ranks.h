#pragma once
// The in-process multi-rank harness: one thread per rank, each with its own
// process group over a shared in-memory store (c10d::HashStore), so tests of
// collectives run real transports without starting processes.

#include "commgrad/dist/process_group.h"

#include <chrono>
#include <functional>
#include <string>

namespace commgrad::testing {

/// Options of spawn_ranks().
struct SpawnOptions {
  /// Transport of each rank's world group.
  TORCH_ARG(std::string, backend) = "gloo";
  /// Collective timeout inside the ranks; the harness gives up (and aborts
  /// the test binary, naming the stuck ranks) some seconds after it.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(20);
};

/// Runs `body(world)` on `world_size` threads, one rank each. The world group
/// is also installed as each thread's commgrad::world(). gtest assertions
/// inside `body` carry a "rank r/n" trace; an exception thrown by a rank is
/// reported as a test failure naming the rank.
///
/// Example:
///   spawn_ranks(4, [](commgrad::Group& g) { EXPECT_EQ(g.size(), 4); });
void spawn_ranks(int world_size, const std::function<void(Group&)>& body, const SpawnOptions& options = {});

}  // namespace commgrad::testing
