// DistributedSampler against PyTorch's DistributedSampler: the indices torch
// 2.15 gives for the same sizes, seeds and epochs (kept below as constants),
// every sample to exactly one rank, the same split at every layout with the
// same data-parallel size, and the default group from the layout.
//
// The constants come from (torch 2.15.0, /work/main/.venv/bin/python):
//   import torch
//   from torch.utils.data.distributed import DistributedSampler
//   class D:
//       def __init__(s, n): s.n = n
//       def __len__(s): return s.n
//   for (n, reps, shuffle, drop, seed, epoch) in CASES:
//       out = []
//       for r in range(reps):
//           s = DistributedSampler(D(n), num_replicas=reps, rank=r, shuffle=shuffle, seed=seed, drop_last=drop)
//           s.set_epoch(epoch)
//           out.append(list(s))
//       print((n, reps, shuffle, drop, seed, epoch), out)

#include "harness/spawn_ranks.h"

#include <commgrad/commgrad.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace commgrad::testing {
namespace {

using Split = std::vector<std::vector<int64_t>>;

struct TorchCase {
  int64_t n;
  int replicas;
  bool shuffle;
  bool drop_last;
  uint64_t seed;
  int64_t epoch;
  Split expected;  // torch 2.15's indices, per rank
};

const std::vector<TorchCase>& torch_cases() {
  static const std::vector<TorchCase> cases = {
      {10, 4, true, false, 0, 0, {{4, 3, 6}, {1, 9, 2}, {7, 0, 4}, {5, 8, 1}}},
      {10, 4, true, false, 0, 1, {{5, 0, 7}, {6, 8, 4}, {1, 9, 5}, {2, 3, 6}}},
      {10, 4, true, true, 0, 0, {{4, 3}, {1, 9}, {7, 0}, {5, 8}}},
      {10, 4, false, false, 0, 0, {{0, 4, 8}, {1, 5, 9}, {2, 6, 0}, {3, 7, 1}}},
      {10, 4, false, true, 0, 0, {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
      {3, 4, true, false, 5, 2, {{0}, {1}, {2}, {0}}},
      {7, 3, true, false, 42, 3, {{5, 2, 0}, {3, 4, 5}, {1, 6, 3}}},
      {2, 5, false, false, 0, 0, {{0}, {1}, {0}, {1}, {0}}},
      {100,
       2,
       true,
       false,
       0,
       0,
       {{44, 93, 71, 37, 53, 81, 80, 74, 76, 82, 26, 57, 16, 89, 97, 31, 35, 65, 98, 20, 78, 94, 4,  59, 54,
         3,  2,  6,  49, 55, 79, 45, 32, 11, 22, 87, 25, 36, 9,  62, 18, 75, 13, 39, 64, 38, 14, 33, 86, 99},
        {19, 90, 69, 95, 91, 42, 85, 56, 63, 40, 92, 10, 66, 41, 8,  24, 30, 7,  23, 29, 61, 15, 52, 5,  46,
         28, 70, 60, 68, 72, 77, 1,  34, 0,  12, 50, 47, 96, 83, 84, 17, 67, 48, 21, 88, 27, 73, 58, 43, 51}}},
  };
  return cases;
}

dp::DistributedSamplerOptions options_of(const TorchCase& c) {
  return dp::DistributedSamplerOptions().shuffle(c.shuffle).drop_last(c.drop_last).seed(c.seed);
}

TEST(DistributedSampler, GivesTorchsIndices) {
  for (const auto& c : torch_cases()) {
    SCOPED_TRACE(c10::str("n=", c.n, " replicas=", c.replicas, " shuffle=", c.shuffle, " drop_last=", c.drop_last,
                          " seed=", c.seed, " epoch=", c.epoch));
    for (int r = 0; r < c.replicas; ++r) {
      EXPECT_EQ(dp::distributed_sampler_indices(c.n, c.replicas, r, c.epoch, options_of(c)), c.expected[r])
          << "rank " << r;
    }
  }
}

TEST(DistributedSampler, EverySampleGoesToOneRankPerEpoch) {
  for (int64_t n : {0, 1, 5, 12, 13}) {
    for (int replicas : {1, 2, 3, 4, 7}) {
      for (int64_t epoch : {0, 1, 2}) {
        std::vector<int> seen(static_cast<size_t>(n), 0);
        int64_t total = 0;
        for (int r = 0; r < replicas; ++r) {
          const auto mine = dp::distributed_sampler_indices(n, replicas, r, epoch);
          total += static_cast<int64_t>(mine.size());
          for (int64_t i : mine) ++seen[static_cast<size_t>(i)];
        }
        const int64_t padded = n == 0 ? 0 : (n + replicas - 1) / replicas * replicas;
        EXPECT_EQ(total, padded) << "n=" << n << " replicas=" << replicas;
        // Each sample once; the padding (fewer than `replicas` samples) once more.
        for (int64_t i = 0; i < n; ++i) {
          EXPECT_GE(seen[static_cast<size_t>(i)], 1) << "sample " << i << " n=" << n << " replicas=" << replicas;
          EXPECT_LE(seen[static_cast<size_t>(i)], 1 + (padded - n + n - 1) / std::max<int64_t>(n, 1));
        }
      }
    }
  }
  // Epochs shuffle differently; the same epoch the same way.
  EXPECT_NE(dp::distributed_sampler_indices(100, 2, 0, 0), dp::distributed_sampler_indices(100, 2, 0, 1));
  EXPECT_EQ(dp::distributed_sampler_indices(100, 2, 0, 3), dp::distributed_sampler_indices(100, 2, 0, 3));
}

TEST(DistributedSampler, SplitsOverTheLayoutsDataParallelGroup) {
  // World 4 at TP = 2 (DP = 2), and world 2 at TP = 1 (DP = 2): data-parallel
  // rank d reads the same samples in both; TP peers read the same samples.
  const int64_t n = 11;
  std::vector<std::vector<int64_t>> at_tp2(4), at_tp1(2);
  spawn_ranks(4, [&](Group& world) {
    ScopedParallelState scope(make_model_parallel(2, 1, world));
    dp::DistributedSampler sampler(n, dp::DistributedSamplerOptions().seed(3));
    sampler.set_epoch(1);
    EXPECT_EQ(sampler.num_replicas(), 2);
    EXPECT_EQ(sampler.rank(), world.rank() / 2);
    EXPECT_EQ(sampler.num_samples(), 6);
    at_tp2[static_cast<size_t>(world.rank())] = sampler.indices();
  });
  spawn_ranks(2, [&](Group& world) {
    ScopedParallelState scope(make_model_parallel(1, 1, world));
    dp::DistributedSampler sampler(n, dp::DistributedSamplerOptions().seed(3));
    sampler.set_epoch(1);
    at_tp1[static_cast<size_t>(world.rank())] = sampler.indices();
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(at_tp2[static_cast<size_t>(r)], at_tp1[static_cast<size_t>(r / 2)]) << r;
  EXPECT_EQ(at_tp1[0], dp::distributed_sampler_indices(n, 2, 0, 1, dp::DistributedSamplerOptions().seed(3)));
}

TEST(DistributedSampler, WithoutALayoutSplitsOverTheWorldAndTakesAGivenGroup) {
  spawn_ranks(3, [](Group& world) {
    dp::DistributedSampler over_world(7);
    EXPECT_EQ(over_world.num_replicas(), 3);
    EXPECT_EQ(over_world.rank(), world.rank());
    EXPECT_EQ(over_world.indices(), dp::distributed_sampler_indices(7, 3, world.rank(), 0));
    dp::DistributedSampler alone(7, dp::DistributedSamplerOptions(self_group()).shuffle(false));
    EXPECT_EQ(alone.num_replicas(), 1);
    EXPECT_EQ(alone.indices(), std::vector<int64_t>({0, 1, 2, 3, 4, 5, 6}));
  });
}

TEST(DistributedSampler, RejectsABadRank) {
  EXPECT_THROW(dp::distributed_sampler_indices(4, 2, 2, 0), c10::Error);
  EXPECT_THROW(dp::distributed_sampler_indices(-1, 2, 0, 0), c10::Error);
}

}  // namespace
}  // namespace commgrad::testing
