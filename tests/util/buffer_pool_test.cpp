// The buffer pool: reuse, size classes, the limit, resizing, threads, and
// that the ops hand out results from it that nobody else references (so that
// autograd can keep a gradient without copying it).

#include "harness/spawn_ranks.h"

#include <commgrad/ops.h>
#include <commgrad/util/buffer_pool.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>
#include <vector>

namespace commgrad {
namespace {

constexpr int64_t kLargeFloats = 1 << 20;  // 4 MiB of float32

// Restores the pool's limit when a test changed it.
struct LimitGuard {
  size_t saved = buffer_pool_stats().limit_bytes;
  ~LimitGuard() { set_buffer_pool_limit(saved); }
};

TEST(BufferPool, SmallTensorsUseTheDefaultAllocator) {
  const auto before = buffer_pool_stats();
  auto t = pooled_empty({16}, at::kFloat);
  EXPECT_EQ(t.sizes(), at::IntArrayRef({16}));
  const auto after = buffer_pool_stats();
  EXPECT_EQ(after.hits + after.misses, before.hits + before.misses);
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
}

TEST(BufferPool, AFreedBlockIsHandedOutAgain) {
  void* first = nullptr;
  {
    auto t = pooled_empty({kLargeFloats}, at::kFloat);
    EXPECT_GE(buffer_pool_stats().in_use_bytes, static_cast<size_t>(kLargeFloats * 4));
    first = t.data_ptr();
    t.fill_(3);
  }
  const auto before = buffer_pool_stats();
  EXPECT_GE(before.cached_bytes, static_cast<size_t>(kLargeFloats * 4));
  // A slightly smaller request falls in the same size class.
  auto again = pooled_empty({kLargeFloats - 100}, at::kFloat);
  EXPECT_EQ(again.data_ptr(), first);
  EXPECT_EQ(buffer_pool_stats().hits, before.hits + 1);
  EXPECT_TRUE(again.is_contiguous());
}

TEST(BufferPool, PooledCopyCopiesAndCastsNonContiguousInput) {
  auto x = at::arange(2 * kLargeFloats, at::kDouble).view({2, kLargeFloats}).t();
  auto y = pooled_copy(x, at::kFloat);
  EXPECT_TRUE(y.is_contiguous());
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(y, x.to(at::kFloat)));
}

TEST(BufferPool, TheLimitBoundsTheCacheAndReleaseEmptiesIt) {
  LimitGuard guard;
  release_cached_buffers();
  EXPECT_EQ(buffer_pool_stats().cached_bytes, 0u);
  set_buffer_pool_limit(0);
  { auto t = pooled_empty({kLargeFloats}, at::kFloat); }
  EXPECT_EQ(buffer_pool_stats().cached_bytes, 0u);

  set_buffer_pool_limit(6u << 20);  // room for one 4 MiB block, not two
  {
    auto a = pooled_empty({kLargeFloats}, at::kFloat);
    auto b = pooled_empty({kLargeFloats}, at::kFloat);
  }
  EXPECT_LE(buffer_pool_stats().cached_bytes, 6u << 20);
  EXPECT_GT(buffer_pool_stats().cached_bytes, 0u);
  release_cached_buffers();
  EXPECT_EQ(buffer_pool_stats().cached_bytes, 0u);
}

TEST(BufferPool, PooledTensorsResizeAndKeepTheirData) {
  auto t = pooled_empty({kLargeFloats}, at::kFloat);
  t.copy_(at::arange(kLargeFloats, at::kFloat));
  t.resize_({3 * kLargeFloats});
  EXPECT_TRUE(at::equal(t.narrow(0, 0, kLargeFloats), at::arange(kLargeFloats, at::kFloat)));
  t.resize_({10});
  EXPECT_EQ(t.numel(), 10);
}

TEST(BufferPool, RejectsWhatItCannotHold) {
  EXPECT_THROW(pooled_empty({4}, at::TensorOptions().dtype(at::kFloat).layout(at::kSparse)), c10::Error);
}

TEST(BufferPool, ThreadsAllocateAndFreeConcurrently) {
  const size_t in_use = buffer_pool_stats().in_use_bytes;
  std::vector<std::thread> threads;
  std::vector<at::Tensor> handed_over(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &handed_over] {
      for (int i = 0; i < 50; ++i) {
        auto x = pooled_empty({kLargeFloats / 2 + 1000 * (i % 3)}, at::kFloat);
        x.fill_(t);
        ASSERT_EQ(x[7].item<float>(), static_cast<float>(t));
        if (i == 49) handed_over[t] = x;  // freed on another thread below
      }
    });
  }
  for (auto& th : threads) th.join();
  handed_over.clear();
  EXPECT_EQ(buffer_pool_stats().in_use_bytes, in_use);
}

// Every op result is owned by the caller alone once the op returned: the
// transport keeps no reference to it (an autograd view of the result handed
// to the transport used to, so autograd copied every large gradient).
TEST(BufferPool, OpResultsAreNotSharedWithTheTransport) {
  testing::spawn_ranks(2, [](Group& g) {
    auto x = at::ones({kLargeFloats});
    auto reduced = ops::raw::all_reduce(x, {}, g).wait();
    EXPECT_EQ(reduced.use_count(), 1);
    EXPECT_TRUE(at::equal(reduced, at::full({kLargeFloats}, 2.0)));
    auto gathered = ops::raw::all_gather(x, {}, g).wait();
    EXPECT_EQ(gathered.numel(), 2 * kLargeFloats);
    auto scattered = ops::raw::reduce_scatter(x, {}, g).wait();
    EXPECT_EQ(scattered.use_count(), 1);
    auto sent = ops::raw::broadcast(x, ops::BroadcastOptions().src(1), g).wait();
    EXPECT_EQ(sent.use_count(), 1);

    // Backward keeps the gradient the op returns instead of copying it.
    auto leaf = x.clone().requires_grad_(true);
    auto y = ops::all_reduce(leaf, {}, g);
    y.backward(at::ones_like(y));
    EXPECT_TRUE(at::equal(leaf.grad(), at::full({kLargeFloats}, 2.0)));
    EXPECT_EQ(leaf.grad().storage().allocator(),
              at::Tensor(pooled_empty({kLargeFloats}, at::kFloat)).storage().allocator());
  });
}

}  // namespace
}  // namespace commgrad
