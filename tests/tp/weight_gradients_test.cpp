// Deferred weight gradients (tp/weight_gradients.h): a forward under
// DeferWeightGradients leaves the weights' gradients to compute(), and
// what compute() accumulates is bit for bit what backward would have:
// column and row layers, with and without sequence parallelism, at TP 1 and
// 2, float32 and float64, non-contiguous inputs. The biases' gradients
// still come from backward. compute() goes through autograd, so
// DistributedDataParallel's hooks reduce the gradients then.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <commgrad/tp/weight_gradients.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing {
namespace {

constexpr int64_t kSeq = 6, kBatch = 3, kHidden = 10, kFfn = 14;

// The gradients of `mlp`'s parameters after loss(mlp(x)).backward(), with the
// weights' deferred or not; x is [s, b, h] non-contiguous.
std::map<std::string, at::Tensor> gradients(tp::ParallelMLP& mlp, const at::Tensor& x, bool sp, const Group& g,
                                            bool defer) {
  for (auto& p : mlp->parameters()) p.mutable_grad() = at::Tensor();
  tp::WeightGradients weights;
  at::Tensor y;
  {
    std::optional<tp::DeferWeightGradients> guard;
    if (defer) guard.emplace(weights);
    const auto in = sp ? tp::scatter_to_sequence_parallel_region(x, g) : x;
    y = mlp(in);
  }
  const auto loss = (y * y).sum();
  loss.backward();
  if (defer) {
    EXPECT_EQ(weights.deferring_layers(), 2u);
    EXPECT_EQ(weights.size(), 2u);  // fc1 and fc2
    EXPECT_FALSE(mlp->fc1->weight.grad().defined());
    EXPECT_FALSE(mlp->fc2->weight.grad().defined());
    EXPECT_TRUE(mlp->fc1->bias.grad().defined());
    weights.compute();
    EXPECT_TRUE(weights.empty());
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& p : mlp->named_parameters()) out[p.key()] = p.value().grad().clone();
  return out;
}

TEST(WeightGradientsTest, DeferredGradientsAreBackwardsBitForBit) {
  for (int n : {1, 2}) {
    for (bool sp : {false, true}) {
      for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
        SCOPED_TRACE("tp=" + std::to_string(n) + (sp ? " sp " : " ") + c10::toString(dtype));
        const auto x = seeded_randn({kBatch, kSeq, kHidden}, 3, dtype).transpose(0, 1);  // [s, b, h]
        spawn_ranks(
            n,
            [&](Group& g) {
              tp::ParallelMLP mlp(tp::ParallelMLPOptions(kHidden, kFfn, g).sequence_parallel(sp).seed(5));
              mlp->to(dtype);
              const auto now = gradients(mlp, x, sp, g, false);
              const auto later = gradients(mlp, x, sp, g, true);
              for (const auto& [name, grad] : now) {
                EXPECT_TRUE(torch::equal(later.at(name), grad))
                    << name << ": max difference " << (later.at(name) - grad).abs().max().item<double>();
              }
            },
            SpawnOptions().backend("shm"));
      }
    }
  }
}

TEST(WeightGradientsTest, AccumulatesAndFiresDataParallelHooks) {
  // Two backwards deferred under no_sync, then compute() with syncing on:
  // DDP reduces (the average of the ranks' sums), as after one synced backward.
  spawn_ranks(
      2,
      [](Group& world) {
        const auto g = commgrad::self_group();
        auto mlp = tp::ParallelMLP(tp::ParallelMLPOptions(kHidden, kFfn, g).seed(5));
        dp::DistributedDataParallel ddp(mlp, world);
        const auto x = seeded_randn({4, kHidden}, 10 + world.rank());
        tp::WeightGradients weights;
        {
          auto hold = ddp.no_sync();
          for (int i = 0; i < 2; ++i) {
            tp::DeferWeightGradients defer(weights);
            mlp(x).pow(2).sum().backward();
          }
        }
        EXPECT_EQ(weights.size(), 4u);
        const auto before = world.state()->sequence.load();
        weights.compute();
        EXPECT_GT(world.state()->sequence.load(), before);  // the buckets were reduced
        // The reference: both ranks' inputs, twice, on one model, averaged over 2 ranks.
        auto ref = tp::ParallelMLP(tp::ParallelMLPOptions(kHidden, kFfn, g).seed(5));
        for (int r = 0; r < 2; ++r) {
          const auto xr = seeded_randn({4, kHidden}, 10 + r);
          (ref(xr).pow(2).sum() * 2).backward();
        }
        for (const auto& p : mlp->named_parameters()) {
          const auto want = ref->named_parameters()[p.key()].grad() / 2;
          EXPECT_TRUE(torch::allclose(p.value().grad(), want, 1e-5, 1e-6)) << p.key();
        }
      },
      SpawnOptions().backend("shm"));
}

TEST(WeightGradientsTest, GuardsNestAndClearForgets) {
  const auto g = commgrad::self_group();
  tp::ColumnParallelLinear fc(tp::ColumnParallelLinearOptions(4, 6, g).seed(1));
  tp::RowParallelLinear out(tp::RowParallelLinearOptions(6, 4, g).seed(2));
  const auto x = seeded_randn({3, 4}, 1);
  tp::WeightGradients outer, inner;
  at::Tensor y;
  {
    tp::DeferWeightGradients a(outer);
    const auto h = fc(x);
    {
      tp::DeferWeightGradients b(inner);
      y = out(h);
    }
  }
  EXPECT_EQ(outer.deferring_layers(), 1u);
  EXPECT_TRUE(outer.empty());  // until backward
  y.sum().backward();
  EXPECT_EQ(outer.size(), 1u);  // fc's
  EXPECT_EQ(inner.size(), 1u);  // out's
  inner.clear();
  EXPECT_EQ(inner.deferring_layers(), 0u);
  outer.compute();
  EXPECT_TRUE(fc->weight.grad().defined());
  EXPECT_FALSE(out->weight.grad().defined());
  // Without a guard nothing is deferred.
  fc->weight.mutable_grad() = at::Tensor();
  fc(x).sum().backward();
  EXPECT_TRUE(fc->weight.grad().defined());
  EXPECT_TRUE(outer.empty());
  // A moved-from queue defers nothing and computes nothing.
  tp::WeightGradients moved = std::move(outer);
  EXPECT_TRUE(outer.empty());
  EXPECT_NO_THROW(outer.compute());
}

}  // namespace
}  // namespace commgrad::testing
