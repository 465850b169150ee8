// DynamicLossScaler on 1-4 ranks (threads, spawn_ranks): the scale follows
// Megatron's rule step by step (hysteresis, back-off, growth, the floor); a
// float16 model with an inf (and a NaN) injected into one rank's gradient
// skips that step on every rank and otherwise equals training without
// scaling bit for bit (power-of-two scales divide out exactly); the ranks
// agree over every group of a layout (tp x dp, tp x pp); the state survives
// state_dict() and a sharded checkpoint; bad options and inputs are errors.

#include "harness/spawn_ranks.h"
#include "harness/temp_dir.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <set>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

// Options whose scale needs a few steps to move.
optim::DynamicLossScalerOptions small(const Group& group) {
  return optim::DynamicLossScalerOptions().initial_scale(1024).min_scale(128).growth_interval(3).hysteresis(2).groups(
      {group});
}

struct Expected {
  bool found_inf;
  double scale;
  int64_t growth, hysteresis, skipped;
};

TEST(DynamicLossScaler, ScaleFollowsMegatronsRuleStepByStep) {
  // initial 1024, floor 128, x2 after 3 finite steps, hysteresis 2.
  const std::vector<Expected> trajectory = {
      {true, 1024, 0, 1, 1},   // first inf: hysteresis 2 -> 1, no back-off
      {true, 512, 0, 0, 2},    // second: tracker 0, back-off
      {true, 256, 0, -1, 3},   // every further inf backs off (no reset)
      {false, 256, 1, -1, 3},  //
      {false, 256, 2, -1, 3},  //
      {false, 512, 0, 2, 3},   // 3 finite steps: growth, hysteresis reset
      {true, 512, 0, 1, 4},    //
      {false, 512, 1, 1, 4},   // a finite step does not restore hysteresis
      {true, 256, 0, 0, 5},    // so this (non-consecutive) inf backs off
      {true, 128, 0, -1, 6},   //
      {true, 128, 0, -2, 7},   // the floor
      {false, 128, 1, -2, 7},  //
      {false, 128, 2, -2, 7},  //
      {false, 256, 0, 2, 7},   //
  };
  optim::DynamicLossScaler scaler(small(self_group()));
  EXPECT_EQ(scaler.scale(), 1024);
  EXPECT_EQ(scaler.hysteresis_tracker(), 2);
  for (size_t k = 0; k < trajectory.size(); ++k) {
    SCOPED_TRACE("update " + std::to_string(k));
    const auto& e = trajectory[k];
    scaler.update(e.found_inf);
    EXPECT_EQ(scaler.scale(), e.scale);
    EXPECT_EQ(scaler.growth_tracker(), e.growth);
    EXPECT_EQ(scaler.hysteresis_tracker(), e.hysteresis);
    EXPECT_EQ(scaler.skipped_steps(), e.skipped);
  }
}

TEST(DynamicLossScaler, DefaultsBackOffAndGrowInClosedForm) {
  // Megatron's defaults: 2^32, hysteresis 2, x0.5 down to 1, x2 every 1000.
  optim::DynamicLossScaler scaler(optim::DynamicLossScalerOptions().groups({self_group()}));
  EXPECT_EQ(scaler.scale(), std::ldexp(1.0, 32));
  for (int n = 1; n <= 40; ++n) {
    scaler.update(true);
    // n consecutive infs: no back-off for the first, then halving, floor 1.
    EXPECT_EQ(scaler.scale(), std::max(std::ldexp(1.0, 32 - std::max(n - 1, 0)), 1.0)) << n << " infs";
  }
  for (int k = 1; k <= 3000; ++k) {
    scaler.update(false);
    EXPECT_EQ(scaler.scale(), std::ldexp(1.0, k / 1000)) << k << " finite steps";
  }
  EXPECT_EQ(scaler.hysteresis_tracker(), 2);
  EXPECT_EQ(scaler.skipped_steps(), 40);
}

// --- a float16 model, one rank's gradient overflows -----------------------

constexpr int64_t kIn = 5;
constexpr int64_t kHidden = 7;
constexpr int64_t kOut = 3;
constexpr int64_t kRows = 4;  // per rank
constexpr int kSteps = 6;

struct HalfNetImpl : torch::nn::Module {
  HalfNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
    torch::NoGradGuard no_grad;
    uint64_t seed = 40;
    for (auto& p : parameters()) p.copy_(seeded_randn(p.sizes(), seed++) * 0.4);
    to(torch::kHalf);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(HalfNet);

// One step's float16 gradients of this rank's rows, summed over the world.
void backward_and_reduce(HalfNet& net, const Group& world, int k, const optim::DynamicLossScaler* scaler) {
  const auto x = seeded_randn({kRows, kIn}, 1000 + 10 * k + world.rank(), torch::kHalf);
  const auto y = seeded_randn({kRows, kOut}, 2000 + 10 * k + world.rank(), torch::kHalf);
  auto loss = (net->forward(x) - y).square().sum();  // float16, gradients of order 1
  (scaler ? scaler->scale(loss) : loss).backward();
  for (auto& p : net->parameters()) ops::raw::all_reduce_(p.mutable_grad(), {}, world).wait();
}

std::vector<at::Tensor> snapshot(HalfNet& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_bitwise_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

class LossScalerRanks : public ::testing::TestWithParam<int> {};

TEST_P(LossScalerRanks, InfOnOneRankSkipsTheStepEverywhereAndOtherStepsEqualUnscaledTraining) {
#if TORCH_VERSION_MAJOR < 2
  GTEST_SKIP() << "LibTorch 1.13 has no float16 matmul on CPU";
#endif
  const int n = GetParam();
  // Step 2: inf on the last rank's gradient; step 3: NaN on rank 0's.
  // Each after the data-parallel sum, so only that rank sees it.
  const int inf_step = 2, nan_step = 3;
  spawn_ranks(n, [&](Group& world) {
    HalfNet net, reference;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    optim::DynamicLossScaler scaler(optim::DynamicLossScalerOptions().initial_scale(256).groups({world}));
    for (int k = 0; k < kSteps; ++k) {
      SCOPED_TRACE("step " + std::to_string(k));
      opt.zero_grad();
      backward_and_reduce(net, world, k, &scaler);
      EXPECT_EQ(net->fc1->weight.grad().scalar_type(), torch::kHalf);
      if (k == inf_step && world.rank() == n - 1) net->fc2->weight.mutable_grad()[1][2] = INFINITY;
      if (k == nan_step && world.rank() == 0) net->fc1->bias.mutable_grad()[0] = NAN;
      const auto before = snapshot(net);
      const bool stepped = scaler.step(opt);

      ref_opt.zero_grad();
      backward_and_reduce(reference, world, k, nullptr);
      const bool skip = k == inf_step || k == nan_step;
      if (!skip) ref_opt.step();

      EXPECT_EQ(stepped, !skip);
      if (skip) expect_bitwise_equal(snapshot(net), before);
      expect_bitwise_equal(snapshot(net), snapshot(reference));
    }
    EXPECT_EQ(scaler.skipped_steps(), 2);
    EXPECT_EQ(scaler.scale(), 128);  // two consecutive infs with hysteresis 2: one back-off
    EXPECT_EQ(scaler.hysteresis_tracker(), 0);
    EXPECT_EQ(scaler.growth_tracker(), kSteps - 1 - nan_step);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, LossScalerRanks, ::testing::Values(2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// --- agreement over the groups of a layout -------------------------------

// Every rank's gradient is `scale` ones (unscaled: ones), but on rank
// `bad_rank` it holds an inf. Returns this rank's unscale_and_check().
bool check_with_inf_on(optim::DynamicLossScaler& scaler, int rank, int bad_rank) {
  auto grad = at::full({3}, scaler.scale(), at::kHalf);
  if (rank == bad_rank) grad[1] = INFINITY;
  const bool found = scaler.unscale_and_check({grad, at::Tensor()});
  if (rank != bad_rank) {
    EXPECT_TRUE(torch::equal(grad, at::ones({3}, at::kHalf)));
  }
  return found;
}

TEST(DynamicLossScaler, RanksAgreeOverEveryGroupOfTheLayout) {
  spawn_ranks(4, [&](Group& world) {
    // TP = 2 x DP = 2: tp [0, 1] [2, 3], dp [0, 2] [1, 3]; the inf is on rank 3.
    const auto state = make_model_parallel(2, 1, world);
    const auto& tp = state.tensor_parallel_group();
    const auto& dp = state.data_parallel_group();
    {
      optim::DynamicLossScaler tp_only(small(tp));
      EXPECT_EQ(check_with_inf_on(tp_only, world.rank(), 3), world.rank() >= 2) << "only tp [2, 3] sees it";
    }
    optim::DynamicLossScaler both(small(dp).groups({dp, tp}));
    EXPECT_TRUE(check_with_inf_on(both, world.rank(), 3));
    ScopedParallelState scope(state);
    optim::DynamicLossScaler by_default(optim::DynamicLossScalerOptions().initial_scale(1024));
    ASSERT_EQ(by_default.groups().size(), 2u);
    EXPECT_EQ(by_default.groups()[0], dp);
    EXPECT_EQ(by_default.groups()[1], tp);
    int steps = 0;
    auto grad = at::full({3}, 1024.0, at::kHalf);
    if (world.rank() == 3) grad[0] = NAN;
    EXPECT_FALSE(by_default.step({grad}, [&] { ++steps; }));
    EXPECT_EQ(steps, 0);
    EXPECT_EQ(by_default.skipped_steps(), 1);
  });
}

TEST(DynamicLossScaler, DefaultGroupsOfATensorByPipelineLayoutSkipTogether) {
  spawn_ranks(4, [&](Group& world) {
    // TP = 2 x PP = 2 (DP = 1): tp [0, 1] [2, 3], pp [0, 2] [1, 3].
    ScopedParallelState scope(make_model_parallel(2, 2, world));
    optim::DynamicLossScaler scaler(optim::DynamicLossScalerOptions().initial_scale(64));
    ASSERT_EQ(scaler.groups().size(), 3u);  // dp (one rank: no traffic), tp, pp
    EXPECT_EQ(scaler.groups()[0].size(), 1);
    EXPECT_EQ(scaler.groups()[2], pipeline_parallel_group());
    for (int bad = 0; bad < 4; ++bad) EXPECT_TRUE(check_with_inf_on(scaler, world.rank(), bad)) << "inf on " << bad;
    EXPECT_FALSE(check_with_inf_on(scaler, world.rank(), -1));
  });
}

// --- state ---------------------------------------------------------------

void expect_same_state(const optim::DynamicLossScaler& a, const optim::DynamicLossScaler& b) {
  EXPECT_EQ(a.scale(), b.scale());
  EXPECT_EQ(a.growth_tracker(), b.growth_tracker());
  EXPECT_EQ(a.hysteresis_tracker(), b.hysteresis_tracker());
  EXPECT_EQ(a.skipped_steps(), b.skipped_steps());
}

const std::vector<bool> kHistory = {true, true, true, false, false, false, true, false};
const std::vector<bool> kFuture = {false, true, true, true, false, false, false};

TEST(DynamicLossScaler, StateDictRoundTripContinuesTheTrajectory) {
  optim::DynamicLossScaler a(small(self_group()));
  for (bool inf : kHistory) a.update(inf);
  const auto state = a.state_dict();
  EXPECT_EQ(state.keys(), (std::vector<std::string>{"scale", "growth_tracker", "hysteresis_tracker", "skipped_steps"}));
  optim::DynamicLossScaler b(small(self_group()));
  b.load_state_dict(state);
  expect_same_state(a, b);
  for (bool inf : kFuture) {
    a.update(inf);
    b.update(inf);
    expect_same_state(a, b);
  }
}

TEST(DynamicLossScaler, CheckpointSaveAndLoadInAFreshScaler) {
  TempRoot root("scaler");
  spawn_ranks(2, [&](Group& world) {
    optim::DynamicLossScaler a(small(world));
    for (bool inf : kHistory) a.update(inf);
    ASSERT_EQ(a.skipped_steps(), 4);
    ASSERT_EQ(a.scale(), 512);  // 1024, 1024, 512, 256, ..., x2 after 3 finite steps, one inf
    checkpoint::save(root.str(), 8, checkpoint::loss_scaler_pieces(a), nlohmann::json::object(), {}, world);

    optim::DynamicLossScaler b(small(world));
    auto pieces = checkpoint::loss_scaler_pieces(b);
    const auto result = checkpoint::load(root.str(), pieces, {}, world);
    checkpoint::restore_loss_scaler(b, pieces, result);
    expect_same_state(a, b);
    for (bool inf : kFuture) {
      a.update(inf);
      b.update(inf);
      expect_same_state(a, b);
    }
  });
}

// --- errors --------------------------------------------------------------

void expect_option_error(const optim::DynamicLossScalerOptions& options, const std::string& text) {
  EXPECT_THROW(optim::DynamicLossScaler{options}, c10::Error) << text;
  EXPECT_THAT(error_of([&] { optim::DynamicLossScaler{options}; }), HasSubstr("[commgrad] DynamicLossScaler: " + text));
}

TEST(DynamicLossScaler, BadOptionsAndInputsAreErrors) {
  const auto ok = optim::DynamicLossScalerOptions().groups({self_group()});
  expect_option_error(optim::DynamicLossScalerOptions(ok).initial_scale(0),
                      "initial_scale must be positive and finite, got 0");
  expect_option_error(optim::DynamicLossScalerOptions(ok).initial_scale(-2),
                      "initial_scale must be positive and finite, got -2");
  expect_option_error(optim::DynamicLossScalerOptions(ok).backoff_factor(1), "backoff_factor must be in (0, 1), got 1");
  expect_option_error(optim::DynamicLossScalerOptions(ok).growth_factor(1), "growth_factor must be above 1");
  expect_option_error(optim::DynamicLossScalerOptions(ok).hysteresis(0), "hysteresis must be at least 1, got 0");
  expect_option_error(optim::DynamicLossScalerOptions(ok).growth_interval(0),
                      "growth_interval must be at least 1, got 0");
  expect_option_error(optim::DynamicLossScalerOptions(ok).initial_scale(4).min_scale(8),
                      "min_scale must be positive and at most initial_scale (4), got 8");

  optim::DynamicLossScaler scaler(ok);
  EXPECT_THROW(scaler.scale(at::Tensor()), c10::Error);
  EXPECT_THAT(error_of([&] { scaler.scale(at::Tensor()); }),
              HasSubstr("DynamicLossScaler::scale: the loss is an undefined tensor"));
  EXPECT_THAT(error_of([&] { scaler.scale(at::ones({}, at::kLong)); }), HasSubstr("must be floating point"));
  EXPECT_THAT(error_of([&] { scaler.unscale_and_check({at::ones({2}, at::kInt)}); }),
              HasSubstr("gradient 0 must be floating point, got int32[2]"));

  auto state = scaler.state_dict();
  state.erase("hysteresis_tracker");
  EXPECT_THAT(error_of([&] { scaler.load_state_dict(state); }),
              HasSubstr("load_state_dict: no 'hysteresis_tracker' entry"));
  state = scaler.state_dict();
  state["scale"] = at::scalar_tensor(-1.0, at::kDouble);
  EXPECT_THAT(error_of([&] { scaler.load_state_dict(state); }), HasSubstr("'scale' must be positive"));
}

TEST(DynamicLossScaler, AGroupThisRankIsNotInIsAnError) {
  spawn_ranks(2, [&](Group& world) {
    const auto first = new_group({0});
    if (world.rank() == 0) {
      optim::DynamicLossScaler scaler(small(first));  // a group of one: no traffic
      auto grad = at::full({2}, 1024.0);
      EXPECT_FALSE(scaler.unscale_and_check({grad}));
    } else {
      EXPECT_THAT(error_of([&] { optim::DynamicLossScaler scaler(small(first)); }),
                  HasSubstr("DynamicLossScaler rank 1 (not a member) group"));
    }
  });
}

}  // namespace
}  // namespace commgrad::testing
