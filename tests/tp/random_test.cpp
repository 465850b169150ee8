// Tests of the tensor-parallel-aware random streams (tp/random.h): dropout in
// replicated regions is identical across TP ranks, dropout in split regions
// differs per TP rank, and both are reproducible from one seed.

#include "commgrad/tp/random.h"

#include "harness/spawn_ranks.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>
#include <vector>

namespace commgrad::tp {
namespace {

using commgrad::testing::spawn_ranks;

// Draws, on each rank of an n-rank TP group seeded with `seed`, one
// replicated dropout mask and one forked (tensor-parallel) mask.
struct Masks {
  std::vector<at::Tensor> replicated, forked;
};

Masks draw_masks(int n, uint64_t seed) {
  Masks masks{std::vector<at::Tensor>(n), std::vector<at::Tensor>(n)};
  spawn_ranks(n, [&](Group& tp) {
    ScopedRngTracker scoped{RngTracker()};
    model_parallel_manual_seed(seed, tp);
    auto ones = torch::ones({13, 5});
    masks.replicated[tp.rank()] = tp::dropout(ones, 0.5, true);
    auto guard = rng_tracker().fork();
    masks.forked[tp.rank()] = tp::dropout(ones, 0.5, true);
  });
  return masks;
}

TEST(TpRandom, ReplicatedStreamIsIdenticalAcrossTpRanks) {
  for (int n : {2, 3, 4}) {
    auto masks = draw_masks(n, 1234);
    for (int r = 1; r < n; ++r) EXPECT_TRUE(torch::equal(masks.replicated[0], masks.replicated[r])) << "n=" << n;
  }
}

TEST(TpRandom, ForkedStreamDiffersPerTpRank) {
  for (int n : {2, 3, 4}) {
    auto masks = draw_masks(n, 1234);
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        EXPECT_FALSE(torch::equal(masks.forked[a], masks.forked[b])) << "ranks " << a << ", " << b << " of " << n;
      }
      // ... and from the replicated stream.
      EXPECT_FALSE(torch::equal(masks.forked[a], masks.replicated[a]));
    }
  }
}

TEST(TpRandom, BothStreamsAreReproducibleFromOneSeed) {
  auto first = draw_masks(2, 99);
  auto second = draw_masks(2, 99);
  auto other = draw_masks(2, 100);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(torch::equal(first.replicated[r], second.replicated[r]));
    EXPECT_TRUE(torch::equal(first.forked[r], second.forked[r]));
    EXPECT_FALSE(torch::equal(first.replicated[r], other.replicated[r]));
    EXPECT_FALSE(torch::equal(first.forked[r], other.forked[r]));
  }
}

TEST(TpRandom, SeedsFollowMegatron) {
  spawn_ranks(3, [](Group& tp) {
    RngTracker tracker;
    model_parallel_manual_seed(5, tp, tracker);
    EXPECT_EQ(tracker.names(), std::vector<std::string>{kModelParallelRng});
    auto expected_tp = at::detail::createCPUGenerator(5 + kTensorParallelSeedOffset + tp.rank());
    auto expected_default = at::detail::createCPUGenerator(5);
    EXPECT_TRUE(torch::equal(tracker.generator(kModelParallelRng).get_state(), expected_tp.get_state()));
    EXPECT_TRUE(torch::equal(tracker.default_generator().get_state(), expected_default.get_state()));
  });
}

TEST(TpRandom, ForkDoesNotAdvanceTheDefaultStream) {
  RngTracker plain, interleaved;
  plain.manual_seed(3);
  interleaved.manual_seed(3);
  plain.add(kModelParallelRng, 4);
  interleaved.add(kModelParallelRng, 4);
  auto x = torch::ones({17});
  auto a1 = tp::dropout(x, 0.3, true, plain);
  auto a2 = tp::dropout(x, 0.3, true, plain);
  auto b1 = tp::dropout(x, 0.3, true, interleaved);
  {
    auto guard = interleaved.fork();
    EXPECT_EQ(interleaved.current_generator(), interleaved.generator(kModelParallelRng));
    tp::dropout(x, 0.3, true, interleaved);
  }
  EXPECT_EQ(interleaved.current_generator(), interleaved.default_generator());
  auto b2 = tp::dropout(x, 0.3, true, interleaved);
  EXPECT_TRUE(torch::equal(a1, b1));
  EXPECT_TRUE(torch::equal(a2, b2));
}

TEST(TpRandom, ForksNestAndAreThreadLocal) {
  RngTracker tracker;
  tracker.add("a", 1);
  tracker.add("b", 2);
  auto outer = tracker.fork("a");
  {
    auto inner = tracker.fork("b");
    EXPECT_EQ(tracker.current_generator(), tracker.generator("b"));
    // Another thread sharing the tracker does not see this thread's forks.
    std::thread([&] { EXPECT_EQ(tracker.current_generator(), tracker.default_generator()); }).join();
    // Another tracker is unaffected.
    RngTracker other;
    EXPECT_EQ(other.current_generator(), other.default_generator());
  }
  EXPECT_EQ(tracker.current_generator(), tracker.generator("a"));
}

TEST(TpRandom, ScopedTrackerIsPerThread) {
  RngTracker mine;
  ScopedRngTracker scoped(mine);
  EXPECT_EQ(rng_tracker(), mine);
  RngTracker seen_by_other;
  std::thread([&] { seen_by_other = rng_tracker(); }).join();
  EXPECT_NE(seen_by_other, mine);
  {
    RngTracker inner;
    ScopedRngTracker nested(inner);
    EXPECT_EQ(rng_tracker(), inner);
  }
  EXPECT_EQ(rng_tracker(), mine);
}

TEST(TpRandom, StatesReplayTheSameDraws) {
  RngTracker tracker;
  tracker.manual_seed(11);
  tracker.add(kModelParallelRng, 12);
  auto x = torch::ones({6, 7});
  auto states = tracker.get_states();
  ASSERT_EQ(states.size(), 2u);
  auto d1 = tp::dropout(x, 0.5, true, tracker);
  at::Tensor f1;
  {
    auto guard = tracker.fork();
    f1 = tp::dropout(x, 0.5, true, tracker);
  }
  tracker.set_states(states);
  EXPECT_TRUE(torch::equal(d1, tp::dropout(x, 0.5, true, tracker)));
  auto guard = tracker.fork();
  EXPECT_TRUE(torch::equal(f1, tp::dropout(x, 0.5, true, tracker)));
}

TEST(TpRandom, ClearErrors) {
  RngTracker tracker;
  tracker.add("a", 1);
  EXPECT_THROW(
      {
        try {
          tracker.add("a", 2);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("already exists"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(
      {
        try {
          tracker.add("b", 1);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("already used by stream 'a'"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(
      {
        try {
          (void)tracker.fork("missing");
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("'missing' was not added"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(tracker.add(kDefaultRng, 7), c10::Error);
  EXPECT_THROW(tracker.set_states({{"missing", torch::Tensor()}}), c10::Error);
  EXPECT_THROW(tp::dropout(torch::ones({2}), 1.5, true, tracker), c10::Error);
  EXPECT_THROW(tp::dropout(torch::ones({2}, torch::kLong), 0.5, true, tracker), c10::Error);
  EXPECT_THROW(model_parallel_manual_seed(1, Group(), tracker), c10::Error);
}

TEST(TpRandom, DropoutSemantics) {
  RngTracker tracker;
  tracker.manual_seed(21);
  auto x = torch::randn({8, 9}, torch::kFloat64).requires_grad_();
  // Not training or p == 0: the input itself.
  EXPECT_TRUE(tp::dropout(x, 0.5, false, tracker).is_same(x));
  EXPECT_TRUE(tp::dropout(x, 0.0, true, tracker).is_same(x));
  EXPECT_TRUE(torch::equal(tp::dropout(x, 1.0, true, tracker), torch::zeros_like(x)));
  // Inverted dropout: kept entries scaled by 1/(1-p); the gradient is the mask.
  auto y = tp::dropout(x, 0.25, true, tracker);
  auto kept = y.ne(0);
  EXPECT_TRUE(torch::allclose(y.masked_select(kept), x.masked_select(kept) / 0.75));
  y.sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), kept.to(torch::kFloat64) / 0.75));
  // The mask depends on the shape and the stream, not on the strides.
  auto base = torch::ones({9, 8}, torch::kFloat64);
  auto states = tracker.get_states();
  auto contiguous = tp::dropout(base.t().contiguous(), 0.5, true, tracker);
  tracker.set_states(states);
  auto transposed = tp::dropout(base.t(), 0.5, true, tracker);
  EXPECT_TRUE(torch::equal(contiguous, transposed));
}

}  // namespace
}  // namespace commgrad::tp
