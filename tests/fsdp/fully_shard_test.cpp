// fully_shard against DistributedDataParallel and against one rank, on
// threads (spawn_ranks): PyTorch's train-parity cases, per-layer units of a
// small transformer with and without resharding after forward (and the
// closed-form count of collectives), gradient accumulation, clipping,
// mixed precision, the bytes held, state dicts, and the errors.

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;
namespace fsdp = commgrad::fsdp;

// ~~~ PyTorch's test_train_parity_single_group ~~~

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out, uint64_t seed) {
    fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, out));
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(seeded_randn(p.sizes(), seed++) * 0.3);
  }
  // Through fsdp::call, so that either layer may be a unit (a plain forward when it is not).
  torch::Tensor forward(const torch::Tensor& x) { return fsdp::call(fc2, torch::relu(fsdp::call(fc1, x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

struct Shapes {
  int64_t in, hidden, out;
};

// (world size, transport). shm sums a reduce-scatter in the order of its
// all-reduce, so the losses are equal bit for bit; Gloo's ring all-reduce
// sums 3 or more ranks in another order than its reduce-scatter.
// zero_grad(set_to_none) on both LibTorch lines (1.13's takes no argument).
void zero_or_drop(const std::vector<at::Tensor>& params, bool drop) {
  for (auto p : params) {
    if (drop) {
      p.mutable_grad().reset();
    } else if (p.grad().defined()) {
      p.mutable_grad().detach_().zero_();
    }
  }
}

class TrainParity : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(TrainParity, OneUnitFollowsDdpWithAdam) {
  const int n = std::get<0>(GetParam());
  const std::string backend = std::get<1>(GetParam());
  const bool bitwise = backend == "shm" || n <= 2;
  for (const Shapes s : {Shapes{16, 15, 8}, Shapes{7, 15, 3}, Shapes{16, 17, 8}}) {
    SCOPED_TRACE(c10::str("shapes (", s.in, ",", s.hidden, ")(", s.hidden, ",", s.out, ")"));
    spawn_ranks(
        n,
        [&](Group& world) {
          Mlp ref(s.in, s.hidden, s.out, 1), model(s.in, s.hidden, s.out, 1);
          dp::DistributedDataParallel ddp(ref, world);
          torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
          auto sharded = fsdp::fully_shard(model, world);
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
          for (int iter = 0; iter < 10; ++iter) {
            const auto x = seeded_randn({4, s.in}, 1000 + 17 * iter + world.rank());
            const auto ref_loss = ref->forward(x).sum();
            const auto loss = fsdp::call(model, x).sum();
            if (bitwise) {
              EXPECT_EQ(loss.item<float>(), ref_loss.item<float>()) << "iteration " << iter;
            } else {
              EXPECT_NEAR(loss.item<float>(), ref_loss.item<float>(), 1e-5 * std::abs(ref_loss.item<float>()) + 1e-6)
                  << "iteration " << iter;
            }
            ref_loss.backward();
            loss.backward();
            ref_opt.step();
            opt.step();
            // Alternate between zeroing and dropping the gradients.
            zero_or_drop(ref->parameters(), iter % 2 == 0);
            zero_or_drop(model->parameters(), iter % 2 == 0);
          }
          const auto full = sharded.full_state_dict();
          for (const auto& item : ref->named_parameters()) {
            if (bitwise) {
              EXPECT_TRUE(torch::equal(full[item.key()], item.value())) << item.key();
            } else {
              EXPECT_TRUE(torch::allclose(full[item.key()], item.value(), 1e-5, 1e-6))
                  << item.key() << ": max difference " << (full[item.key()] - item.value()).abs().max().item<double>();
            }
          }
        },
        SpawnOptions().backend(backend));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, TrainParity,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8), ::testing::Values("shm", "gloo")),
                         [](const auto& info) {
                           return std::get<1>(info.param) + "_world" + std::to_string(std::get<0>(info.param));
                         });

// ~~~ A small transformer, one unit per layer ~~~

constexpr int64_t kModel = 16, kHeads = 4, kLayers = 3, kSeq = 5, kBatch = 2;

struct TransformerImpl : torch::nn::Module {
  TransformerImpl() {
    input = register_module("input", torch::nn::Linear(kModel, kModel));
    for (int64_t i = 0; i < kLayers; ++i) {
      layers.push_back(register_module(
          "layer" + std::to_string(i),
          torch::nn::TransformerEncoderLayer(
              torch::nn::TransformerEncoderLayerOptions(kModel, kHeads).dim_feedforward(2 * kModel).dropout(0.0))));
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    // The same values in every thread (the global generator is shared).
    torch::NoGradGuard no_grad;
    uint64_t seed = 300;
    for (auto& p : parameters()) p.copy_(seeded_randn(p.sizes(), seed++) * 0.2);
  }
  // `delay` runs before each layer (to shift the ranks against each other).
  torch::Tensor forward(const torch::Tensor& x, const std::function<void()>& delay = {}) {
    auto h = input(x);
    for (auto& layer : layers) {
      if (delay) delay();
      h = fsdp::call(layer, h);
    }
    return norm(h);
  }
  torch::nn::Linear input{nullptr};
  std::vector<torch::nn::TransformerEncoderLayer> layers;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Transformer);

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

class PerLayerUnits : public ::testing::TestWithParam<bool> {};

TEST_P(PerLayerUnits, FollowDdpWithDelaysAndCountTheCollectives) {
  const bool reshard = GetParam();
  const int n = 3;
  spawn_ranks(
      n,
      [&](Group& world) {
        Transformer ref, model;
        dp::DistributedDataParallel ddp(ref, world);
        torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
        for (auto& layer : model->layers)
          fsdp::fully_shard(layer, fsdp::FullyShardOptions(world).reshard_after_forward(reshard));
        auto sharded = fsdp::fully_shard(model, fsdp::FullyShardOptions(world).reshard_after_forward(reshard));
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
        ASSERT_EQ(sharded.units().size(), static_cast<size_t>(kLayers + 1));
        const int slow = 1;
        for (int step = 0; step < 4; ++step) {
          const auto x = seeded_randn({kSeq, kBatch, kModel}, 50 + 3 * step + world.rank());
          const auto ref_loss = ref->forward(x).pow(2).mean();
          // Delays before the all-gathers (each layer), the reduce-scatters (backward) and the step.
          const auto loss = fsdp::call(model, x,
                                       [&] {
                                         if (world.rank() == (step + slow) % n) sleep_ms(3);
                                       })
                                .pow(2)
                                .mean();
          EXPECT_EQ(loss.item<float>(), ref_loss.item<float>()) << "step " << step;
          ref_loss.backward();
          if (world.rank() == step % n) sleep_ms(5);
          loss.backward();
          if (world.rank() == (step + 2) % n) sleep_ms(5);
          ref_opt.step();
          opt.step();
          ref_opt.zero_grad();
          opt.zero_grad();
          // Closed form: every unit gathered in forward; in backward again all
          // but the root when resharding; one reduce-scatter per unit.
          const auto stats = sharded.last_step();
          EXPECT_EQ(stats.all_gathers, reshard ? 2 * kLayers + 1 : kLayers + 1);
          EXPECT_EQ(stats.reduce_scatters, kLayers + 1);
          if (step > 0) {
            EXPECT_GT(stats.prefetched, 0);
          }
        }
        // shm reduces in DDP's order: the same parameters bit for bit.
        const auto full = sharded.full_state_dict();
        for (const auto& item : ref->named_parameters()) {
          EXPECT_TRUE(torch::equal(full[item.key()], item.value()))
              << item.key() << ": max difference " << (full[item.key()] - item.value()).abs().max().item<double>();
        }
        // After the step nothing gathered is alive: the shards and the pieces' gradients only.
        int64_t shard_bytes = 0;
        for (const auto& u : sharded.units()) shard_bytes += u.shard_numel * 4;
        EXPECT_EQ(sharded.parameter_bytes(), shard_bytes);
      },
      SpawnOptions().backend("shm"));
}

INSTANTIATE_TEST_SUITE_P(ReshardAfterForward, PerLayerUnits, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "reshard" : "keep"; });

// ~~~ Accumulation, clipping and the bytes held ~~~

TEST(FullyShard, AccumulationAndClippingEqualOneRank) {
  const int steps = 5;
  for (int micro : {1, 3}) {
    SCOPED_TRACE("microbatches " + std::to_string(micro));
    // One rank alone over all the data...
    std::vector<at::Tensor> reference;
    {
      Mlp net(9, 13, 5, 3);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int k = 0; k < steps; ++k) {
        for (int mb = 0; mb < micro; ++mb) {
          net->forward(seeded_randn({6, 9}, 10 * k + mb)).pow(2).mean().div(micro).backward();
        }
        optim::clip_grad_norm_(net->parameters(), 0.5);
        opt.step();
        opt.zero_grad();
      }
      for (const auto& p : net->parameters()) reference.push_back(p.detach().clone());
    }
    // ...and 2 ranks with the same data on every rank.
    spawn_ranks(2, [&](Group& world) {
      Mlp net(9, 13, 5, 3);
      fsdp::fully_shard(net->fc1, world);
      auto sharded = fsdp::fully_shard(net, world);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int k = 0; k < steps; ++k) {
        for (int mb = 0; mb < micro; ++mb) {
          auto loss = [&] { return fsdp::call(net, seeded_randn({6, 9}, 10 * k + mb)).pow(2).mean().div(micro); };
          if (mb + 1 < micro) {
            auto guard = sharded.no_sync();
            loss().backward();
            EXPECT_GT(sharded.gradient_bytes(), 0);
          } else {
            loss().backward();
          }
        }
        // This rank's pieces hold the gradients: 1/N of them.
        int64_t shard_bytes = 0;
        for (const auto& u : sharded.units()) shard_bytes += u.shard_numel * 4;
        EXPECT_EQ(sharded.gradient_bytes(), shard_bytes);
        sharded.clip_grad_norm_(0.5);
        opt.step();
        opt.zero_grad();
      }
      const auto full = sharded.full_state_dict();
      size_t i = 0;
      for (const auto& item : full) {
        EXPECT_TRUE(torch::allclose(item.value(), reference[i], 1e-6, 1e-6)) << item.key();
        ++i;
      }
    });
  }
}

// ~~~ HSDP ~~~

TEST(FullyShard, HybridShardingFollowsDdpOverTheWholeWorld) {
  spawn_ranks(4, [&](Group& world) {
    // Shard over {0, 1} and {2, 3}; replicate over {0, 2} and {1, 3} (FSDP2's 2-D mesh).
    std::vector<Group> shard{new_group({0, 1}), new_group({2, 3})};
    std::vector<Group> replicate{new_group({0, 2}), new_group({1, 3})};
    const int r = world.rank();
    Mlp ref(7, 11, 3, 2), model(7, 11, 3, 2);
    dp::DistributedDataParallel ddp(ref, world);
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
    fsdp::fully_shard(model->fc1, fsdp::FullyShardOptions(shard[r / 2]).replicate_group(replicate[r % 2]));
    auto sharded = fsdp::fully_shard(model, fsdp::FullyShardOptions(shard[r / 2]).replicate_group(replicate[r % 2]));
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 5; ++step) {
      const auto x = seeded_randn({4, 7}, 400 + 10 * step + r);
      const auto ref_loss = ref->forward(x).pow(2).sum();
      const auto loss = fsdp::call(model, x).pow(2).sum();
      EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5 * std::abs(ref_loss.item<double>()));
      ref_loss.backward();
      loss.backward();
      ref_opt.step();
      opt.step();
      ref_opt.zero_grad();
      opt.zero_grad();
    }
    const auto full = sharded.full_state_dict();
    for (const auto& item : ref->named_parameters()) {
      EXPECT_TRUE(torch::allclose(full[item.key()], item.value(), 1e-5, 1e-6))
          << item.key() << ": max difference " << (full[item.key()] - item.value()).abs().max().item<double>();
    }
  });
}

// ~~~ Mixed precision ~~~

TEST(FullyShard, Bfloat16ComputeWithFloat32ReductionMatchesAnEmulation) {
  const int n = 2, steps = 4;
  spawn_ranks(n, [&](Group& world) {
    Mlp net(8, 12, 4, 5), emulated(8, 12, 4, 5);
    auto sharded =
        fsdp::fully_shard(net, fsdp::FullyShardOptions(world).mixed_precision(
                                   dp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)));
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
    // The emulation: float32 masters, a bfloat16 copy for compute, the
    // gradients averaged in float32.
    std::vector<at::Tensor> masters;
    for (const auto& p : emulated->parameters()) masters.push_back(p.detach().clone().requires_grad_(false));
    torch::optim::SGD master_opt(masters, torch::optim::SGDOptions(0.05));
    emulated->to(at::kBFloat16);
    for (int k = 0; k < steps; ++k) {
      const auto x = seeded_randn({4, 8}, 70 + k + world.rank());
      const auto y = fsdp::call(net, x);
      EXPECT_EQ(y.scalar_type(), at::kBFloat16);
      y.to(at::kFloat).pow(2).sum().backward();
      opt.step();
      opt.zero_grad();

      emulated->forward(x.to(at::kBFloat16)).to(at::kFloat).pow(2).sum().backward();
      auto params = emulated->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        auto g = params[i].grad().to(at::kFloat).div(n);
        g = ops::raw::all_reduce(g, ops::AllReduceOptions().op(ReduceOp::kSum), world).wait();
        masters[i].mutable_grad() = g;
      }
      master_opt.step();
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].copy_(masters[i]);
        params[i].mutable_grad().reset();
      }
    }
    const auto full = sharded.full_state_dict();
    size_t i = 0;
    for (const auto& item : full) {
      EXPECT_EQ(item.value().scalar_type(), at::kFloat);
      EXPECT_TRUE(torch::allclose(item.value(), masters[i], 1e-6, 1e-6))
          << item.key() << ": max difference " << (item.value() - masters[i]).abs().max().item<double>();
      ++i;
    }
  });
}

// ~~~ Errors ~~~

TEST(FullyShardErrors, WrongUse) {
  spawn_ranks(2, [&](Group& world) {
    {  // Twice.
      Mlp net(4, 6, 2, 1);
      fsdp::fully_shard(net, world);
      EXPECT_THROW_WITH(fsdp::fully_shard(net, world), "already a unit");
    }
    {  // Parameters replaced after sharding (to() gives them new data).
      Mlp net(4, 6, 2, 1);
      fsdp::fully_shard(net, world);
      net->to(at::kDouble);
      EXPECT_THROW_WITH(fsdp::call(net, torch::ones({1, 4})), "was replaced after fully_shard");
    }
    {  // A unit called twice in one forward.
      struct TwiceImpl : torch::nn::Module {
        TwiceImpl() { fc = register_module("fc", torch::nn::Linear(3, 3)); }
        torch::Tensor forward(const torch::Tensor& x) { return fsdp::call(fc, fsdp::call(fc, x)); }
        torch::nn::Linear fc{nullptr};
      };
      auto twice = std::make_shared<TwiceImpl>();
      fsdp::fully_shard(twice->fc, world);
      fsdp::fully_shard(twice, world);
      EXPECT_THROW_WITH(fsdp::call(twice, torch::ones({1, 3})), "called twice in one forward");
    }
    {  // A sharded module run without call().
      Mlp net(4, 6, 2, 1);
      fsdp::fully_shard(net->fc1, world);
      fsdp::fully_shard(net, world);
      EXPECT_ANY_THROW(net->forward(torch::ones({1, 4})).sum().backward());
    }
  });
}

TEST(FullyShardErrors, RanksWithDifferentUnitsGetAnErrorNotAHang) {
  spawn_ranks(2, [&](Group& world) {
    Mlp net(4, 6 + world.rank(), 2, 1);
    EXPECT_THROW_WITH(fsdp::fully_shard(net, world), "the replicas differ");
  });
}

// The same model wrapped into other units on each rank (fc1 a unit of its
// own on rank 0 only; every shape alike): an error on every rank, no hang
// (the replica check compares the names the units hold).
TEST(FullyShardErrors, RanksThatWrapOtherUnitsOfTheSameModelGetAnErrorNotAHang) {
  spawn_ranks(
      2,
      [&](Group& world) {
        Mlp net(4, 6, 2, 1);
        try {
          if (world.rank() == 0) fsdp::fully_shard(net->fc1, world);
          auto sharded = fsdp::fully_shard(net, world);
          fsdp::call(net, seeded_randn({3, 4}, 9)).sum().backward();
          sharded.finish_gradients();
          ADD_FAILURE() << "units that differ across ranks were accepted";
        } catch (const std::exception& e) {
          EXPECT_THAT(e.what(), HasSubstr("the replicas differ"));
          EXPECT_THAT(e.what(), HasSubstr("rank 0 has parameter 'weight' float32[6, 4], rank 1 has parameter "
                                          "'fc1.weight' float32[6, 4]"));
        }
      },
      SpawnOptions().timeout(std::chrono::seconds(10)));
}

// output_dtype: the outermost unit's floating-point outputs come out in it
// (bfloat16 compute, float32 outputs, as FSDP2's), the loss and the
// gradients as with the cast written by hand.
TEST(FullyShard, OutputDtypeCastsTheOutermostOutputs) {
  spawn_ranks(2, [&](Group& world) {
    Mlp net(4, 6, 2, 1), by_hand(4, 6, 2, 1);
    const auto policy = dp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    auto sharded = fsdp::fully_shard(
        net, fsdp::FullyShardOptions(world).mixed_precision(dp::MixedPrecisionPolicy(policy).output_dtype(at::kFloat)));
    auto reference = fsdp::fully_shard(by_hand, fsdp::FullyShardOptions(world).mixed_precision(policy));
    const auto x = seeded_randn({3, 4}, 9 + world.rank());
    const auto y = fsdp::call(net, x);
    const auto r = fsdp::call(by_hand, x);
    EXPECT_EQ(y.scalar_type(), at::kFloat);
    EXPECT_EQ(r.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(torch::equal(y, r.to(at::kFloat)));
    y.pow(2).sum().backward();
    r.to(at::kFloat).pow(2).sum().backward();
    sharded.finish_gradients();
    reference.finish_gradients();
    const auto a = net->named_parameters(), b = by_hand->named_parameters();
    for (const auto& item : a) {
      EXPECT_TRUE(torch::equal(item.value().grad(), b[item.key()].grad())) << item.key();
    }
  });
}

// An optimizer over the parameters as they were before fully_shard would
// step tensors whose gradients backward drops: the next forward says so,
// naming the parameter; Adam and SGD built afterwards train without it.
TEST(FullyShardErrors, AnOptimizerBuiltBeforeFullyShardIsAnErrorAtTheNextForward) {
  spawn_ranks(2, [&](Group& world) {
    for (bool adam : {false, true}) {
      Mlp net(4, 6, 2, 1);
      std::unique_ptr<torch::optim::Optimizer> early;
      if (adam) {
        early = std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2));
      } else {
        early = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
      }
      auto sharded = fsdp::fully_shard(net, world);
      const auto x = seeded_randn({3, 4}, 9 + world.rank());
      fsdp::call(net, x).sum().backward();
      early->step();
      EXPECT_THROW_WITH(fsdp::call(net, x), "fully_shard", "rank", "an optimizer stepped parameter 'fc",
                        "before fully_shard", "after fully_shard");
    }
    Mlp net(4, 6, 2, 1);
    auto sharded = fsdp::fully_shard(net, world);
    torch::optim::Adam late(net->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      late.zero_grad();
      fsdp::call(net, seeded_randn({3, 4}, 9 + world.rank())).sum().backward();
      late.step();
    }
  });
}

TEST(FullyShard, FrozenParametersAreNotReduced) {
  spawn_ranks(2, [&](Group& world) {
    Mlp net(4, 6, 2, 1);
    net->fc1->weight.set_requires_grad(false);
    auto sharded = fsdp::fully_shard(net, world);
    fsdp::call(net, seeded_randn({3, 4}, 9 + world.rank())).sum().backward();
    for (const auto& item : net->named_parameters()) {
      EXPECT_EQ(item.value().grad().defined(), item.key() != "fc1.weight") << item.key();
    }
  });
}

}  // namespace
}  // namespace commgrad::testing
