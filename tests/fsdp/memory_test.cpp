// The bytes the sharded wrappers hold, measured from LibTorch's CPU
// allocator rather than from their own accessors: a counting allocator
// wraps c10::GetCPUAllocator() for this test program, and every rank
// (threads, spawn_ranks) stops at a barrier while rank 0 reads how many
// bytes are alive. Against the closed forms over the layout the wrappers
// report (ranges and units, whose sizes are not bytes), summed over the
// ranks, after the second step and again after the third step's backward:
//   ZeRO-1  parameters (flat, padded) + DDP's buckets + Adam's 8 bytes per element of the ranges
//   ZeRO-2  parameters (flat, padded) + the ranges' gradients + Adam's state
//   FSDP    16 bytes per element of the shards (parameter, gradient, Adam's two)
// A wrapper that kept a full gradient bucket (or a gathered unit) alive after
// backward holds at least one bucket (unit) more than the closed form, which
// is far above the tolerance (the transports' small bookkeeping).

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <commgrad/detail/torch_compat.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <c10/core/CPUAllocator.h>

namespace commgrad::testing {
namespace {

namespace fsdp = commgrad::fsdp;

// Counts the bytes of every live CPU allocation made through it.
class CountingAllocator final : public commgrad::detail::AllocatorBase {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate_bytes(size_t n) const override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    const auto device = inner.device();
    live_ += static_cast<int64_t>(n);
    return c10::DataPtr(data, new Counted{std::move(inner), n, &live_}, &release, device);
  }
  int64_t live() const { return live_.load(); }

 private:
  struct Counted {
    c10::DataPtr inner;
    size_t bytes;
    std::atomic<int64_t>* live;
  };
  static void release(void* context) {
    auto* c = static_cast<Counted*>(context);
    *c->live -= static_cast<int64_t>(c->bytes);
    delete c;
  }
  c10::Allocator* inner_;
  mutable std::atomic<int64_t> live_{0};
};

CountingAllocator& counting() {
  static CountingAllocator* allocator = [] {
    auto* a = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(a, /*priority=*/100);
    return a;
  }();
  return *allocator;
}

// Waits until nothing of an earlier test is freed any more (its transport's
// threads may drop their last buffers after it returned): the count holds
// still over five reads 20 ms apart.
void settle() {
  int64_t last = counting().live();
  for (int still = 0, rounds = 0; still < 5 && rounds < 100; ++rounds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const int64_t now = counting().live();
    still = now == last ? still + 1 : 0;
    last = now;
  }
}

constexpr int kRanks = 2;
constexpr int64_t kWidth = 48;  // three 48x48 layers: buckets of ~9 KiB
constexpr int64_t kRows = 4;
// The transports' and autograd's small bookkeeping that may outlive a step.
constexpr int64_t kTolerance = 1024;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int i = 0; i < 3; ++i)
      layers.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(kWidth, kWidth)));
    torch::NoGradGuard no_grad;
    uint64_t seed = 70;
    for (auto& p : parameters()) p.copy_(seeded_randn(p.sizes(), seed++) * 0.1);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(fsdp::call(l, x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Net);

// Every rank at a barrier while rank 0 reads the live bytes (the same on
// every rank afterwards).
int64_t live_bytes(const Group& world) {
  ops::raw::barrier(world).wait();
  auto live = at::full({1}, world.rank() == 0 ? counting().live() : 0, at::kLong);
  ops::raw::barrier(world).wait();
  ops::raw::all_reduce_(live, {}, world).wait();
  return live.item<int64_t>();
}

// Sums an integer over the ranks.
int64_t total(const Group& world, int64_t mine) {
  auto t = at::full({1}, mine, at::kLong);
  ops::raw::all_reduce_(t, {}, world).wait();
  return t.item<int64_t>();
}

// Steps `step` (a zero_grad, forward, backward and optimizer step) twice,
// then runs a third backward; checks the live bytes above `baseline`
// against `expected_after_step` and `expected_after_backward`.
template <class Step>
void expect_bytes(const Group& world, int64_t baseline, const Step& step, const std::function<int64_t()>& after_step,
                  const std::function<int64_t()>& after_backward) {
  for (int k = 0; k < 2; ++k) step(k, /*update=*/true);
  const int64_t held = live_bytes(world) - baseline;
  EXPECT_NEAR(held, after_step(), kTolerance) << "after two steps";
  step(2, /*update=*/false);
  const int64_t held_in_step = live_bytes(world) - baseline;
  EXPECT_NEAR(held_in_step, after_backward(), kTolerance) << "after the third backward";
}

at::Tensor input(int k, int rank) { return seeded_randn({kRows, kWidth}, 800 + 10 * k + rank); }

class ZeroBytes : public ::testing::TestWithParam<int> {};

TEST_P(ZeroBytes, TheAllocatorHoldsTheClosedForm) {
  const int stage = GetParam();
  settle();
  spawn_ranks(
      kRanks,
      [&](Group& world) {
        const int64_t baseline = live_bytes(world);
        Net net;
        optim::ZeroOptimizer zero(
            net,
            [](auto shards) { return std::make_unique<torch::optim::Adam>(shards, torch::optim::AdamOptions(1e-3)); },
            optim::ZeroOptimizerOptions(
                dp::DistributedDataParallelOptions(world).bucket_cap_mb(0.008).first_bucket_cap_mb(0.008))
                .stage(stage));
        int64_t padded = 0, ranges = 0;
        for (const auto& s : zero.shards()) {
          padded += s.padded_numel;
          ranges += s.end - s.begin;
        }
        ASSERT_GT(zero.shards().size(), 2u);
        auto step = [&](int k, bool update) {
          zero.zero_grad();
          net->forward(input(k, world.rank())).sum().backward();
          if (update) zero.step();
        };
        // Per rank: the flat parameters (4 bytes per padded element), Adam's two
        // states over the ranges, and the gradients: ZeRO-1 DDP's whole buckets,
        // ZeRO-2 the ranges only.
        const int64_t grads = stage == 1 ? 4 * padded : 4 * ranges;
        const int64_t expected = total(world, 4 * padded + 8 * ranges + grads);
        expect_bytes(
            world, baseline, step, [&] { return expected; }, [&] { return expected; });
      },
      SpawnOptions().backend("shm"));
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroBytes, ::testing::Values(1, 2),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

TEST(FsdpBytes, TheAllocatorHoldsSixteenBytesPerShardElement) {
  settle();
  spawn_ranks(
      kRanks,
      [&](Group& world) {
        const int64_t baseline = live_bytes(world);
        Net net;
        for (auto& l : net->layers) fsdp::fully_shard(l, world);
        auto sharded = fsdp::fully_shard(net, world);
        torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
        int64_t shard = 0;
        for (const auto& u : sharded.units()) shard += u.shard_numel;
        auto step = [&](int k, bool update) {
          for (auto& p : net->parameters()) p.mutable_grad().reset();
          fsdp::call(net, input(k, world.rank())).sum().backward();
          if (update) opt.step();
        };
        // Parameters 4, gradients 4 (each unit's reduced shard, which its
        // pieces' gradients alias), Adam 8 bytes per element of the pieces
        // (which tile the shard but its padding).
        int64_t pieces = 0;
        for (const auto& p : net->parameters()) pieces += p.numel();
        const int64_t expected = total(world, 4 * shard + 4 * shard + 8 * pieces);
        expect_bytes(
            world, baseline, step, [&] { return expected; }, [&] { return expected; });
      },
      SpawnOptions().backend("shm"));
}

}  // namespace
}  // namespace commgrad::testing
