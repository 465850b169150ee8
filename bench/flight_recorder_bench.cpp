// The flight recorder's own cost per collective: the three notes ops makes
// for every collective (issued, on the transport, finished), in a loop on one
// group, without communication, so that the machine's load hardly blurs a
// difference of nanoseconds. Run it with COMMGRAD_TRACE_BUFFER_SIZE=0 (only
// the terminate handler's record) and unset (the ring):
// bench/flight_recorder_cost.sh does both, alternating, and sets them
// against commgrad-bench's small all_reduce.

#include "commgrad/dist/flight_recorder.h"
#include "commgrad/dist/group.h"
#include "commgrad/util/env.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <memory>

int main() {
  namespace detail = commgrad::detail;
  auto group = std::make_shared<detail::GroupState>();
  group->name = "world";
  group->ranks = {0, 1};
  group->rank = 0;
  group->global_rank = 0;
  const at::Tensor x = at::ones({1024});
  constexpr int kIters = 200000;
  constexpr int kRepeats = 15;
  double best = std::numeric_limits<double>::max();
  uint64_t sequence = 0;
  for (int rep = 0; rep < kRepeats; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kIters; ++i) {
      const uint64_t record = detail::note_collective_started("all_reduce", sequence++, group, x);
      detail::note_collective_posted(record);
      detail::note_collective_finished(record);
    }
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count() / kIters);
  }
  const auto ring = commgrad::env::get("COMMGRAD_TRACE_BUFFER_SIZE");
  std::printf("flight recorder: %.1f ns per collective (ring %s; best of %d x %d)\n", best,
              ring && !ring->empty() ? ring->c_str() : "default", kRepeats, kIters);
  return 0;
}
