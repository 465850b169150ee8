// The copy routines under the shm engine, tested directly: the streaming
// copy and copy_bytes at every alignment and distance, collectives at every
// offset in a page and in unaligned tensors, the choice between streaming
// and ordinary stores, and the developer's A/B blocks.

#include "backend/shm_harness.h"
#include "detail/shm_ab_blocks.h"
#include "detail/shm_copy.h"
#include "detail/shm_stores.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace shm_test;

// The streaming copy at every destination alignment and a range of lengths
// (head up to 16 bytes, whole lines, tail), leaving the bytes around alone.
TEST(ShmStoreChoice, StreamingCopyIsExactAtEveryAlignment) {
  std::vector<uint8_t> src(512), dst(512 + 64);
  std::iota(src.begin(), src.end(), uint8_t{1});
  for (int64_t offset = 0; offset < 20; ++offset) {
    for (int64_t len : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 200, 333}) {
      std::fill(dst.begin(), dst.end(), uint8_t{0xee});
      commgrad::backend::detail::copy_streaming(dst.data() + offset, src.data() + 3, len);
      for (int64_t i = 0; i < static_cast<int64_t>(dst.size()); ++i) {
        const bool inside = i >= offset && i < offset + len;
        ASSERT_EQ(dst[i], inside ? src[i - offset + 3] : uint8_t{0xee})
            << "offset " << offset << " length " << len << " byte " << i;
      }
    }
  }
}

// copy_bytes at every distance of destination from source that takes its
// own loop (1-63 bytes past, modulo 4096) and around it, at lengths about
// the loop's 2 KiB start and 64-byte step, leaving the bytes around alone.
TEST(ShmCopy, CopyBytesIsExactAtEveryDistance) {
  constexpr int64_t kPage = 4096;
  constexpr int64_t kMost = 70001;
  auto page_aligned = [](int64_t bytes) {  // aligned_alloc wants a multiple of the alignment
    const auto rounded = static_cast<size_t>((bytes + kPage - 1) / kPage * kPage);
    return std::unique_ptr<uint8_t, decltype(&std::free)>(static_cast<uint8_t*>(std::aligned_alloc(kPage, rounded)),
                                                          &std::free);
  };
  auto src = page_aligned(kMost + kPage);
  auto dst = page_aligned(kMost + 3 * kPage);
  for (int64_t i = 0; i < kMost; ++i) src.get()[i + 5] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<int64_t> distances;
  for (int64_t d = 0; d <= 130; ++d) distances.push_back(d);
  for (int64_t d = kPage - 70; d < kPage; ++d) distances.push_back(d);
  for (int64_t d : distances) {
    for (int64_t len : std::vector<int64_t>{0, 1, 127, 2047, 2048, 2049, 2048 + 64 + 5, 4096 + 131, 65536, kMost}) {
      uint8_t* to = dst.get() + kPage + 5 + d;  // 5: neither pointer aligned
      std::memset(dst.get(), 0xee, static_cast<size_t>(kMost + 3 * kPage));
      commgrad::backend::detail::copy_bytes(to, src.get() + 5, len);
      ASSERT_EQ(std::memcmp(to, src.get() + 5, static_cast<size_t>(len)), 0) << "distance " << d << " length " << len;
      for (uint8_t* p = to - 64; p < to; ++p) ASSERT_EQ(*p, 0xee) << "distance " << d << " length " << len;
      for (uint8_t* p = to + len; p < to + len + 64; ++p) ASSERT_EQ(*p, 0xee) << "distance " << d << " length " << len;
    }
  }
}

// The collectives' copies between a caller's tensor and the segment at
// every float offset within a page, so that some distances fall where
// copy_bytes takes its own loop, whichever page offset the slots have.
TEST(ShmCopy, CollectivesRightAtEveryOffsetInAPage) {
  run_ranks(2, RunOptions{}, [](Rank& r) {
    const int64_t numel = 1000;  // 4000 bytes: rep movsb's range in memcpy
    std::vector<at::Tensor> all;
    for (int q = 0; q < r.size; ++q) all.push_back(make_input(numel, at::kFloat, q, 77));
    at::Tensor backing = at::zeros({numel * r.size + 1024});
    for (int64_t at_float = 0; at_float < 1024; ++at_float) {
      at::Tensor b = backing.narrow(0, at_float, numel);
      b.copy_(r.rank == 0 ? all[0] : at::zeros({numel}));
      std::vector<at::Tensor> t{b};
      r.shm->broadcast(t)->wait();
      ASSERT_TRUE(same_bits(b, all[0])) << "broadcast at float " << at_float;
      at::Tensor gathered = backing.narrow(0, at_float, numel * r.size);
      at::Tensor mine = all[r.rank].clone();
      r.shm->_allgather_base(gathered, mine)->wait();
      ASSERT_TRUE(same_bits(gathered, at::cat(all))) << "_allgather_base at float " << at_float;
    }
  });
}

// Results of 16 MiB and more (kStreamResultBytes) go into the caller's
// tensor with streaming stores, except with ordinary stores only: a
// broadcast, an _allgather_base and a list all-gather of that size, into
// tensors that start 4 bytes into their storage and end mid-line, at 2 and
// 3 ranks, bit for bit, with a guard element on each side left alone.
TEST(ShmCopy, LargeResultsRightInUnalignedTensors) {
  for (const auto stores : {2, 0}) {
    for (const int ranks : {2, 3}) {
      RunOptions o;
      o.shm.streaming_stores(stores);
      run_ranks(ranks, o, [stores](Rank& r) {
        const int64_t part = (int64_t{16} << 20) / 4 / r.size + 3;  // floats: the results are 16 MiB and more
        std::vector<at::Tensor> all;
        for (int q = 0; q < r.size; ++q) all.push_back(make_input(part, at::kFloat, q, 91 + stores));
        const at::Tensor whole = at::cat(all);
        const int64_t n = whole.numel();
        at::Tensor backing = at::full({n + 2}, -7.0f);
        at::Tensor b = backing.narrow(0, 1, n);
        if (r.rank == 0) b.copy_(whole);
        std::vector<at::Tensor> t{b};
        r.shm->broadcast(t)->wait();
        EXPECT_TRUE(same_bits(b, whole)) << "broadcast, streaming_stores " << stores;
        backing.fill_(-7.0f);
        at::Tensor mine = all[r.rank].clone();
        r.shm->_allgather_base(b, mine)->wait();
        EXPECT_TRUE(same_bits(b, whole)) << "_allgather_base, streaming_stores " << stores;
        std::vector<std::vector<at::Tensor>> outs(1);
        for (int q = 0; q < r.size; ++q) outs[0].push_back(b.narrow(0, q * part, part));
        backing.fill_(-7.0f);
        std::vector<at::Tensor> in{mine};
        r.shm->allgather(outs, in)->wait();
        EXPECT_TRUE(same_bits(b, whole)) << "allgather, streaming_stores " << stores;
        EXPECT_EQ(backing[0].item<float>(), -7.0f);
        EXPECT_EQ(backing[n + 1].item<float>(), -7.0f);
      });
    }
  }
}

// kAdaptive's state machine, fed with made-up durations: kSlowToStream
// slow ordinary writes in a row start a streamed run of kStreamedWrites,
// after which ordinary writes are timed again; a fast one in between starts
// the count again; small writes never stream nor count.
TEST(ShmStoreChoice, StreamsWhileOrdinaryWritesRunSlow) {
  using commgrad::backend::detail::StoreChoice;
  using commgrad::backend::detail::StoreMode;
  constexpr int64_t kBig = StoreChoice::kLargeBytes;
  const int64_t fast_ns = 1000;                                                        // 65.5 GB/s
  const auto slow_ns = static_cast<int64_t>(kBig / StoreChoice::kSlowBytesPerNs) + 1;  // just below the line
  StoreChoice c(StoreMode::kAdaptive);
  EXPECT_FALSE(c.stream(kBig - 1));
  EXPECT_FALSE(c.times(kBig - 1));
  EXPECT_TRUE(c.times(kBig));
  auto slow_writes = [&](int k) {
    for (int i = 0; i < k; ++i) {
      EXPECT_FALSE(c.stream(kBig)) << "ordinary write " << i << " of " << k;
      c.observe(kBig, slow_ns);
    }
  };
  slow_writes(StoreChoice::kSlowToStream - 1);
  c.observe(kBig, fast_ns);
  slow_writes(StoreChoice::kSlowToStream - 1);
  EXPECT_FALSE(c.stream(kBig)) << "a fast write in between starts the count again";
  c.observe(kBig, slow_ns);
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < StoreChoice::kStreamedWrites; ++i) {
      EXPECT_FALSE(c.stream(kBig - 1)) << "small writes stay ordinary";
      EXPECT_TRUE(c.stream(kBig)) << "streamed write " << i << " of run " << round;
    }
    slow_writes(StoreChoice::kSlowToStream);  // the run is over: ordinary writes are timed again
  }
  for (int i = 0; i < StoreChoice::kStreamedWrites; ++i) c.stream(kBig);
  EXPECT_FALSE(c.stream(kBig));
  c.observe(kBig, fast_ns);
  EXPECT_FALSE(c.stream(kBig)) << "fast ordinary writes stay ordinary";

  StoreChoice ordinary(StoreMode::kCached), streaming(StoreMode::kStreaming);
  for (int i = 0; i < 3; ++i) ordinary.observe(kBig, slow_ns);
  EXPECT_FALSE(ordinary.stream(kBig));
  EXPECT_FALSE(ordinary.times(kBig));
  EXPECT_TRUE(streaming.stream(kBig));
  EXPECT_FALSE(streaming.stream(kBig - 1));
  EXPECT_FALSE(streaming.times(kBig));
}

// The developer's A/B, fed with a made-up clock: variants 0-3 in turn, one
// block each; a block is timed when the next one starts; B's collectives
// take 80 ns against A's 100, so B/A is 0.8 and the A/A controls 1.
TEST(ShmAbBlocks, AlternatesVariantsAndTimesEachBlock) {
  using commgrad::backend::detail::AbBlocks;
  EXPECT_THROW(AbBlocks(0), std::invalid_argument);
  constexpr int kBlock = 3;
  AbBlocks ab(kBlock);
  int64_t now = 1000;
  for (uint64_t seq = 0; seq < 10 * kBlock; ++seq) {
    const int variant = ab.begin(seq, now);
    ASSERT_EQ(variant, static_cast<int>(seq / kBlock % 4)) << "collective " << seq;
    EXPECT_EQ(ab.runs_b(), variant % 2 == 1) << "collective " << seq;
    now += seq < kBlock ? 1000 : ab.runs_b() ? 80 : 100;  // the first block: a slow warm-up
  }
  // Eight blocks timed, two of each variant: not the first (the warm-up),
  // nor the tenth (in progress).
  for (int v = 0; v < 4; ++v) EXPECT_EQ(ab.blocks(v), 2u) << "variant " << v;
  EXPECT_EQ(ab.median_ns(0), 100);
  EXPECT_EQ(ab.median_ns(1), 80);
  EXPECT_EQ(ab.median_a_ns(), 100);
  EXPECT_EQ(ab.median_b_ns(), 80);
  const std::string report = ab.report("rank 0/2 group 'world' (shm)");
  EXPECT_NE(report.find("shm A/B rank 0/2 group 'world' (shm): block 3, blocks 2 2 2 2"), std::string::npos) << report;
  EXPECT_NE(report.find("A 100 B 80, B/A 0.800, control v2/v0 1.000 v3/v1 1.000"), std::string::npos) << report;
  EXPECT_EQ(AbBlocks(5).median_ns(2), 0) << "no block timed yet";
}

}  // namespace
