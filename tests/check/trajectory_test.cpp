// check_trajectory: TP=2 x DP=2 training with ZeRO-2 and clipping, its
// groups from the layout, follows a plain one-rank LibTorch run (the
// reference MLP with torch::optim::AdamW and clip_grad_norm_) step by step;
// the same loop with a deliberate mistake (the parallel run does not clip)
// is reported, with the first step that diverges.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing {
namespace {

constexpr int64_t kModel = 6, kFfn = 8, kBatch = 8;
constexpr int kSteps = 5;

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.02));
}

check::TrajectoryResult run(bool forget_clipping) {
  const auto x = seeded_randn({kSteps, kBatch, kModel}, 1), y = seeded_randn({kSteps, kBatch, kModel}, 2);
  check::TrajectoryResult out;
  spawn_ranks(4, [&](Group& world) {
    const auto state = make_model_parallel(2, 1, world);
    ScopedParallelState scope(state);
    tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn).seed(42));
    auto options = optim::ZeroOptimizerOptions().stage(2).max_grad_norm(0.05);
    if (forget_clipping) options.max_grad_norm(0);
    optim::ZeroOptimizer zero(mlp, adamw, options);
    ReferenceMLP reference(kModel, kFfn, true, 42);
    auto reference_opt = adamw(reference->parameters());
    const int dp = state.data_parallel_rank();
    const auto result = check::check_trajectory(
        [&](int k) {
          zero.zero_grad();
          auto loss = torch::mse_loss(mlp->forward(x[k].chunk(2, 0)[dp]), y[k].chunk(2, 0)[dp]);
          loss.backward();
          zero.step();
          return loss.item<double>();
        },
        *mlp,
        [&](int k) {
          reference_opt->zero_grad();
          auto loss = torch::mse_loss(reference->forward(x[k]), y[k]);
          loss.backward();
          optim::clip_grad_norm_(reference->parameters(), 0.05);
          reference_opt->step();
          return loss.item<double>();
        },
        *reference, check::TrajectoryOptions(kSteps).title("ParallelMLP TP=2 x DP=2"));
    if (world.rank() == 0) out = result;
  });
  return out;
}

TEST(TrajectoryCheck, ZeroWithClippingFollowsOneRank) {
  const auto result = run(false);
  EXPECT_TRUE(result.ok()) << result;
  EXPECT_EQ(result.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(result.parameters.size(), 4u);  // fc1/fc2 weight and bias
  EXPECT_THAT(result.table(), ::testing::HasSubstr("all steps and parameters agree"));
}

TEST(TrajectoryCheck, FindsTheStepWhereARunParts) {
  const auto result = run(true);
  EXPECT_FALSE(result.ok()) << result;
  EXPECT_GE(result.first_divergent_step, 1) << result;  // step 1's loss comes before any update
  EXPECT_THAT(result.table(), ::testing::HasSubstr("DIVERGES"));
}

}  // namespace
}  // namespace commgrad::testing
