// ZeroOptimizer (ZeRO-1 and ZeRO-2) on 1-4 ranks (threads, spawn_ranks):
// K steps with gradient accumulation (no_sync) and global-norm clipping end
// with the same parameters as DistributedDataParallel + the same
// torch::optim optimizer + optim::clip_grad_norm_, bit for bit on shm (it
// sums a reduce-scatter in the order of its all-reduce, and every update is
// per element) and on Gloo at 2 ranks; within rounding on Gloo at 3-4.
// Layer sizes are odd so that buckets do not split evenly and parameters
// straddle the ranks' ranges. Also: the state is 1/N of DDP's, gathered
// state equals the unsharded optimizer's, resume from a full state dict,
// learning-rate schedules, TP = 2 x DP = 2 against the unsplit model, and
// the errors.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kIn = 7;
constexpr int64_t kHidden = 13;
constexpr int64_t kOut = 5;
constexpr int64_t kBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr int kMicro = 2;       // microbatches per step (one under no_sync)

struct NetImpl : torch::nn::Module {
  // The same initial values in every thread (the global generator is shared).
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kHidden));
    fc3 = register_module("fc3", torch::nn::Linear(kHidden, kOut));
    torch::NoGradGuard no_grad;
    uint64_t seed = 100;
    for (auto& p : parameters()) p.copy_(seeded_randn(p.sizes(), seed++) * 0.3);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

enum class Kind { kSgd, kAdam, kAdamW };

std::string kind_name(Kind k) { return k == Kind::kSgd ? "SGD" : k == Kind::kAdam ? "Adam" : "AdamW"; }

std::unique_ptr<torch::optim::Optimizer> make(Kind kind, std::vector<at::Tensor> params) {
  switch (kind) {
    case Kind::kSgd:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
    case Kind::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
    case Kind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
  }
  return nullptr;
}

// Small buckets: several per model, the first one tiny.
dp::DistributedDataParallelOptions small_buckets(const Group& group) {
  return dp::DistributedDataParallelOptions(group).bucket_cap_mb(0.0004).first_bucket_cap_mb(0.0001);
}

struct Batches {
  at::Tensor x, y;  // [steps, micro, batch, ...]
};
Batches batches(int steps) {
  return {seeded_randn({steps, kMicro, kBatch, kIn}, 11), seeded_randn({steps, kMicro, kBatch, kOut}, 12)};
}

// One training step on this rank's rows: kMicro - 1 microbatches under
// no_sync, the last one synchronised.
template <class Sync, class Step>
void train_step(Net& net, const Batches& data, int k, int rank, int n, Sync&& no_sync, Step&& step) {
  for (int mb = 0; mb < kMicro; ++mb) {
    auto x = data.x[k][mb].chunk(n, 0)[rank];
    auto y = data.y[k][mb].chunk(n, 0)[rank];
    if (mb + 1 < kMicro) {
      auto guard = no_sync();
      torch::mse_loss(net->forward(x), y).backward();
    } else {
      torch::mse_loss(net->forward(x), y).backward();
    }
  }
  step();
}

void expect_equal_parameters(Net& a, Net& b, bool bitwise) {
  auto pa = a->named_parameters();
  auto pb = b->named_parameters();
  for (const auto& item : pa) {
    const auto& other = pb[item.key()];
    const bool wide = item.value().scalar_type() == at::kFloat || item.value().scalar_type() == at::kDouble;
    if (!wide && !bitwise) {
      EXPECT_TRUE(torch::allclose(item.value().to(at::kFloat), other.to(at::kFloat), 2e-2, 2e-3)) << item.key();
      continue;
    }
    if (bitwise) {
      EXPECT_TRUE(torch::equal(item.value(), other))
          << item.key() << ": max difference " << (item.value() - other).abs().max().item<double>();
    } else {
      EXPECT_TRUE(torch::allclose(item.value(), other, 1e-5, 1e-6))
          << item.key() << ": max difference " << (item.value() - other).abs().max().item<double>();
    }
  }
}

// (world size, stage, transport)
class ZeroMatchesDdp : public ::testing::TestWithParam<std::tuple<int, int, std::string>> {};

TEST_P(ZeroMatchesDdp, TenStepsWithAccumulationAndClippingEqualDdpBitForBit) {
  const int n = std::get<0>(GetParam());
  const int stage = std::get<1>(GetParam());
  const std::string backend = std::get<2>(GetParam());
  const int steps = 10;
  const auto data = batches(steps);
  spawn_ranks(
      n,
      [&](Group& world) {
        for (Kind kind : {Kind::kSgd, Kind::kAdam, Kind::kAdamW}) {
          SCOPED_TRACE(kind_name(kind));
          Net ref_net, zero_net;
          dp::DistributedDataParallel ddp(ref_net, small_buckets(world));
          auto ref_opt = make(kind, ref_net->parameters());
          optim::ZeroOptimizer zero(
              zero_net, [&](auto shards) { return make(kind, shards); },
              optim::ZeroOptimizerOptions(small_buckets(world)).stage(stage).max_grad_norm(0.05));
          EXPECT_GT(zero.shards().size(), 2u);
          for (int k = 0; k < steps; ++k) {
            train_step(
                ref_net, data, k, world.rank(), n, [&] { return ddp.no_sync(); },
                [&] {
                  optim::clip_grad_norm_(ref_net->parameters(), 0.05);
                  ref_opt->step();
                  ref_opt->zero_grad();
                });
            double norm = 0;
            train_step(
                zero_net, data, k, world.rank(), n, [&] { return zero.no_sync(); },
                [&] {
                  norm = zero.step();
                  zero.zero_grad();
                });
            EXPECT_GT(norm, 0.05) << "the clipping is not exercised at step " << k;
          }
          // shm sums all-reduce and reduce-scatter in rank order; Gloo's ring
          // all-reduce sums 3 or 4 ranks in another order than its reduce-scatter.
          expect_equal_parameters(zero_net, ref_net, /*bitwise=*/backend == "shm" || n <= 2);
          if (stage == 2) {
            for (const auto& p : zero_net->parameters()) EXPECT_FALSE(p.grad().defined());
          }
          // The gathered state is the unsharded optimizer's.
          const auto full = zero.full_state_dict();
          const auto ref = optim::unsharded_state_dict(*ref_net, *ref_opt);
          ASSERT_EQ(full.size(), ref.size());
          for (const auto& item : ref) {
            ASSERT_TRUE(full.contains(item.key())) << item.key();
            EXPECT_TRUE(torch::allclose(full[item.key()], item.value(), 1e-5, 1e-7))
                << item.key() << ": max difference " << (full[item.key()] - item.value()).abs().max().item<double>()
                << " of max " << item.value().abs().max().item<double>();
          }
        }
      },
      SpawnOptions().backend(backend));
}

INSTANTIATE_TEST_SUITE_P(WorldsAndStages, ZeroMatchesDdp,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values(1, 2),
                                            ::testing::Values("shm", "gloo")),
                         [](const auto& info) {
                           return std::get<2>(info.param) + "_world" + std::to_string(std::get<0>(info.param)) +
                                  "_stage" + std::to_string(std::get<1>(info.param));
                         });

// bfloat16 parameters and gradients, float32 master weights: the same as
// DDP in bfloat16 with float32 copies of the parameters stepped by the same
// optimizer and rounded back.
class ZeroMixedPrecision : public ::testing::TestWithParam<std::string> {};

TEST_P(ZeroMixedPrecision, Bfloat16WithFloat32MastersMatchesDdp) {
  const std::string backend = GetParam();
  const int steps = 6;
  const auto data = batches(steps);
  spawn_ranks(
      3,
      [&](Group& world) {
        Net ref_net, zero_net;
        ref_net->to(at::kBFloat16);
        zero_net->to(at::kBFloat16);
        dp::DistributedDataParallel ddp(ref_net, small_buckets(world));
        const auto ref_params = ref_net->parameters();
        std::vector<at::Tensor> masters;
        for (const auto& p : ref_params) masters.push_back(p.detach().to(at::kFloat));
        auto ref_opt = make(Kind::kAdamW, masters);
        optim::ZeroOptimizer zero(
            zero_net, [](auto shards) { return make(Kind::kAdamW, shards); },
            optim::ZeroOptimizerOptions(small_buckets(world)).stage(2).max_grad_norm(0.05));
        for (int k = 0; k < steps; ++k) {
          // Forward in bfloat16, the loss in float32 (1.13 has no bfloat16 mse on CPU).
          auto loss = [&](Net& net, int mb) {
            auto x = data.x[k][mb].chunk(3, 0)[world.rank()].to(at::kBFloat16);
            auto y = data.y[k][mb].chunk(3, 0)[world.rank()];
            return (net->forward(x).to(at::kFloat) - y).pow(2).mean();
          };
          for (int mb = 0; mb < kMicro; ++mb) {
            if (mb + 1 < kMicro) {
              auto g1 = ddp.no_sync();
              auto g2 = zero.no_sync();
              loss(ref_net, mb).backward();
              loss(zero_net, mb).backward();
            } else {
              loss(ref_net, mb).backward();
              loss(zero_net, mb).backward();
            }
          }
          torch::NoGradGuard no_grad;
          for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = ref_params[i].grad().to(at::kFloat);
          optim::clip_grad_norm_(masters, 0.05);
          ref_opt->step();
          for (size_t i = 0; i < masters.size(); ++i) {
            ref_params[i].copy_(masters[i]);
            ref_params[i].mutable_grad() = at::Tensor();
          }
          zero.step();
        }
        expect_equal_parameters(zero_net, ref_net, /*bitwise=*/backend == "shm");
        // The float32 masters travel with the state.
        const auto full = zero.full_state_dict();
        const auto names = ref_net->named_parameters();
        for (size_t i = 0; i < names.size(); ++i) {
          const auto key = names[i].key() + "/master";
          ASSERT_TRUE(full.contains(key)) << key;
          EXPECT_EQ(full[key].scalar_type(), at::kFloat);
          EXPECT_TRUE(backend == "shm" ? torch::equal(full[key], masters[i])
                                       : torch::allclose(full[key], masters[i], 1e-2, 1e-3))
              << key;
        }
      },
      SpawnOptions().backend(backend));
}

INSTANTIATE_TEST_SUITE_P(Transports, ZeroMixedPrecision, ::testing::Values("shm", "gloo"));

int64_t parameter_count(Net& net) {
  int64_t count = 0;
  for (const auto& p : net->parameters()) count += p.numel();
  return count;
}

TEST(ZeroOptimizer, StateAndGradientsAreShardedOneNth) {
  const auto data = batches(1);
  for (int stage : {1, 2}) {
    spawn_ranks(4, [&](Group& world) {
      Net net;
      const int64_t psi = parameter_count(net);
      optim::ZeroOptimizer zero(
          net, [](auto shards) { return make(Kind::kAdam, shards); },
          optim::ZeroOptimizerOptions(small_buckets(world)).stage(stage));
      EXPECT_EQ(zero.state_bytes(), 0);
      train_step(
          net, data, 0, world.rank(), 4, [&] { return zero.no_sync(); }, [&] { zero.step(); });
      // Adam: exp_avg + exp_avg_sq, 8 bytes per element of this rank's ranges.
      int64_t mine = 0;
      for (const auto& s : zero.shards()) mine += s.end - s.begin;
      EXPECT_EQ(zero.state_bytes(), 8 * mine);
      auto total = at::full({1}, mine, at::kLong);
      ops::raw::all_reduce_(total, {}, world).wait();
      EXPECT_EQ(total.item<int64_t>(), psi);  // the ranges cover every parameter once
      const int64_t buckets = static_cast<int64_t>(zero.shards().size());
      EXPECT_LE(mine, psi / 4 + buckets);
      if (stage == 1) {
        EXPECT_GE(zero.gradient_bytes(), 4 * psi);
      } else {
        EXPECT_LE(zero.gradient_bytes(), 4 * (psi / 4 + buckets));
      }
    });
  }
}

TEST(ZeroOptimizer, ResumesFromAFullStateDictAtAnotherWorldSize) {
  // Train 3 steps on one rank without sharding, then hand the state to a
  // ZeroOptimizer on 3 ranks and go on: equal to 6 unsharded steps.
  const auto data = batches(6);
  Net ref_net;
  auto ref_opt = make(Kind::kAdam, ref_net->parameters());
  torch::OrderedDict<std::string, at::Tensor> params_at_3, state_at_3;
  for (int k = 0; k < 6; ++k) {
    if (k == 3) {
      for (const auto& p : ref_net->named_parameters()) params_at_3.insert(p.key(), p.value().detach().clone());
      state_at_3 = optim::unsharded_state_dict(*ref_net, *ref_opt);
    }
    ref_opt->zero_grad();
    for (int mb = 0; mb < kMicro; ++mb) torch::mse_loss(ref_net->forward(data.x[k][mb]), data.y[k][mb]).backward();
    ref_opt->step();
  }
  spawn_ranks(3, [&](Group& world) {
    Net net;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->named_parameters()) p.value().copy_(params_at_3[p.key()]);
    }
    optim::ZeroOptimizer zero(
        net, [](auto shards) { return make(Kind::kAdam, shards); },
        optim::ZeroOptimizerOptions(small_buckets(world)).stage(2));
    zero.load_full_state_dict(state_at_3);
    EXPECT_EQ(zero.step_count(), 3);
    for (int k = 3; k < 6; ++k) {
      train_step(
          net, data, k, world.rank(), 3, [&] { return zero.no_sync(); },
          [&] {
            zero.step();
            zero.zero_grad();
          });
    }
    // The mean over each rank's rows averaged over ranks is the full
    // batch's mean up to rounding.
    expect_equal_parameters(net, ref_net, /*bitwise=*/false);
  });
}

TEST(ZeroOptimizer, LearningRateSchedulesDriveTheShardOptimizer) {
  const auto data = batches(4);
  spawn_ranks(2, [&](Group& world) {
    Net ref_net, zero_net;
    dp::DistributedDataParallel ddp(ref_net, small_buckets(world));
    auto ref_opt = make(Kind::kSgd, ref_net->parameters());
    torch::optim::StepLR ref_sched(*ref_opt, 1, 0.5);
    optim::ZeroOptimizer zero(
        zero_net, [](auto shards) { return make(Kind::kSgd, shards); },
        optim::ZeroOptimizerOptions(small_buckets(world)));
    torch::optim::StepLR sched(zero.optimizer(), 1, 0.5);
    for (int k = 0; k < 4; ++k) {
      train_step(
          ref_net, data, k, world.rank(), 2, [&] { return ddp.no_sync(); },
          [&] {
            ref_opt->step();
            ref_opt->zero_grad();
            ref_sched.step();
          });
      train_step(
          zero_net, data, k, world.rank(), 2, [&] { return zero.no_sync(); },
          [&] {
            zero.step();
            zero.zero_grad();
            sched.step();
          });
    }
    expect_equal_parameters(zero_net, ref_net, /*bitwise=*/true);
  });
}

// With sequence parallelism each TP rank holds part of the tokens; the
// row-parallel bias's gradient is then partial (partial_grad), and
// ZeroOptimizer sums it over the TP group itself.
class ZeroTensorParallel : public ::testing::TestWithParam<bool> {};

// How the optimizer gets its groups.
enum class Groups {
  kExplicit,     // the DP and TP groups given
  kFromLayout,   // none given, the layout current
  kTpFromModule  // the DP group given, no TP group and no layout
};

// TP=2 x DP=2, 4 steps of ZeRO-2 with clipping, against the unsplit model.
// kFromLayout: the layout is the current one and the optimizer is given no
// group at all (the natural code); its DP and TP groups must come from the
// layout (not the world, which would average TP rank 0's shards with TP rank
// 1's and clip each TP rank by its own norm). kTpFromModule: without a layout
// and a TP group, the norm's TP group is the one the module's shards are
// split over (it used to be none: each TP rank clipped by its own norm).
void train_two_by_two(bool sp, Groups groups) {
  const bool groups_from_layout = groups == Groups::kFromLayout;
  constexpr int64_t kModel = 6, kFfn = 10;
  const int steps = 4;
  const auto x = seeded_randn({steps, 8, kModel}, 1);
  const auto y = seeded_randn({steps, 8, kModel}, 2);
  ReferenceMLP reference(kModel, kFfn, true, 42);
  auto ref_opt = make(Kind::kAdamW, reference->parameters());
  for (int k = 0; k < steps; ++k) {
    ref_opt->zero_grad();
    torch::mse_loss(reference->forward(x[k]), y[k]).backward();
    optim::clip_grad_norm_(reference->parameters(), 0.1);
    ref_opt->step();
  }
  spawn_ranks(4, [&](Group& world) {
    auto state = commgrad::make_model_parallel(2, 1, world);
    std::optional<commgrad::ScopedParallelState> scope;
    if (groups_from_layout) scope.emplace(state);
    tp::ParallelMLP mlp(
        tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).sequence_parallel(sp).seed(42));
    auto options =
        optim::ZeroOptimizerOptions(small_buckets(groups_from_layout ? Group() : state.data_parallel_group()))
            .stage(2)
            .max_grad_norm(0.1);
    if (groups == Groups::kExplicit) options.tensor_parallel_group(state.tensor_parallel_group());
    optim::ZeroOptimizer zero(
        mlp, [](auto shards) { return make(Kind::kAdamW, shards); }, options);
    EXPECT_EQ(zero.group(), state.data_parallel_group());
    const int dp = state.data_parallel_rank();
    const int tp = state.tensor_parallel_rank();
    for (int k = 0; k < steps; ++k) {
      zero.zero_grad();
      auto in = x[k].chunk(2, 0)[dp];
      auto want = y[k].chunk(2, 0)[dp];
      if (sp) {
        // This TP rank's tokens; the mean over all of them is the mean of the TP ranks' means.
        torch::mse_loss(mlp->forward(in.chunk(2, 0)[tp]), want.chunk(2, 0)[tp]).div(2).backward();
      } else {
        torch::mse_loss(mlp->forward(in), want).backward();
      }
      EXPECT_GT(zero.step(), 0.1);
    }
    const auto full = tp::gather_full_state_dict(*mlp);
    for (const auto& p : reference->named_parameters()) {
      ASSERT_TRUE(full.contains(p.key())) << p.key();
      EXPECT_TRUE(torch::allclose(full[p.key()], p.value(), 1e-5, 1e-6))
          << p.key() << ": max difference " << (full[p.key()] - p.value()).abs().max().item<double>();
    }
  });
}

TEST_P(ZeroTensorParallel, TwoByTwoMatchesTheUnsplitModel) { train_two_by_two(GetParam(), Groups::kExplicit); }
TEST_P(ZeroTensorParallel, GroupsComeFromTheCurrentLayout) { train_two_by_two(GetParam(), Groups::kFromLayout); }
TEST_P(ZeroTensorParallel, NormGroupComesFromTheModulesShards) { train_two_by_two(GetParam(), Groups::kTpFromModule); }

INSTANTIATE_TEST_SUITE_P(SequenceParallel, ZeroTensorParallel, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "sp" : "no_sp"; });

// register_gradient_hook: each rank's hook sees its ranges of the averaged
// gradient (every element on exactly one rank, equal to one process's
// gradient of the whole batch), before clipping: a hook that zeroes them
// makes step() report a norm of 0 and SGD leave the parameters alone.
TEST(ZeroOptimizer, GradientHooksSeeTheReducedGradientsBeforeClipping) {
  const auto data = batches(1);
  Net whole;
  for (int mb = 0; mb < kMicro; ++mb) torch::mse_loss(whole->forward(data.x[0][mb]), data.y[0][mb]).backward();
  for (int stage : {1, 2}) {
    spawn_ranks(3, [&](Group& world) {
      Net net;
      optim::ZeroOptimizer zero(
          net, [](auto shards) { return std::make_unique<torch::optim::SGD>(shards, torch::optim::SGDOptions(0.1)); },
          optim::ZeroOptimizerOptions(small_buckets(world)).stage(stage).max_grad_norm(1e-3));
      const auto expected = whole->named_parameters();
      int64_t seen = 0;
      bool zero_them = false;
      zero.register_gradient_hook([&](const std::vector<optim::ZeroOptimizer::StateShard>& grads) {
        for (const auto& g : grads) {
          EXPECT_EQ(g.state, "grad");
          if (zero_them) {
            g.tensor.zero_();
            continue;
          }
          const auto want = expected[g.param].grad().reshape(-1).narrow(0, g.param_begin, g.tensor.numel());
          EXPECT_TRUE(torch::allclose(g.tensor, want, 1e-5, 1e-7)) << g.param << " from " << g.param_begin;
          seen += g.tensor.numel();
        }
      });
      train_step(
          net, data, 0, world.rank(), 3, [&] { return zero.no_sync(); }, [&] { EXPECT_GT(zero.step(), 1e-3); });
      auto total = at::full({1}, seen, at::kLong);
      ops::raw::all_reduce_(total, {}, world).wait();
      EXPECT_EQ(total.item<int64_t>(), parameter_count(net));
      zero_them = true;
      std::vector<at::Tensor> before;
      for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
      train_step(
          net, data, 0, world.rank(), 3, [&] { return zero.no_sync(); }, [&] { EXPECT_EQ(zero.step(), 0.0); });
      for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(net->parameters()[i], before[i]));
      EXPECT_THROW(zero.register_gradient_hook(nullptr), c10::Error);
    });
  }
}

TEST(ZeroOptimizer, StepWithoutASynchronisedBackwardIsAnError) {
  const auto data = batches(1);
  spawn_ranks(2, [&](Group& world) {
    Net net;
    optim::ZeroOptimizer zero(
        net, [](auto shards) { return make(Kind::kAdam, shards); }, optim::ZeroOptimizerOptions(small_buckets(world)));
    try {
      zero.step();
      ADD_FAILURE() << "step() before any backward did not throw";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("ZeroOptimizer rank " + std::to_string(world.rank()) +
                            "/2 group 'world' (gloo): step() "
                            "without a synchronised backward since the last step (bucket 0 of"));
    }
    {
      auto guard = zero.no_sync();
      torch::mse_loss(net->forward(data.x[0][0]), data.y[0][0]).backward();
    }
    EXPECT_THROW(zero.step(), c10::Error);  // only accumulated
  });
}

TEST(ZeroOptimizer, BadOptionsAreErrors) {
  spawn_ranks(1, [&](Group& world) {
    Net net;
    auto factory = [](auto shards) { return make(Kind::kAdam, shards); };
    try {
      optim::ZeroOptimizer zero(net, factory, optim::ZeroOptimizerOptions(world).stage(3));
      ADD_FAILURE() << "stage 3 was accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("ZeroOptimizer: stage must be 1"));
    }
    EXPECT_THROW(optim::ZeroOptimizer(net, nullptr, optim::ZeroOptimizerOptions(world)), c10::Error);
    EXPECT_THROW(optim::clip_grad_norm_(net->parameters(), 0.0), c10::Error);
    torch::optim::LBFGS lbfgs(net->parameters());
    try {
      optim::get_param_state(lbfgs, net->parameters()[0]);
      ADD_FAILURE() << "LBFGS state was accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("is not supported (Adam, AdamW, SGD, Adagrad and RMSprop are"));
    }
  });
}

}  // namespace
}  // namespace commgrad::testing
