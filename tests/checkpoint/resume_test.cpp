// Resume from a sharded checkpoint of a model and its ZeroOptimizer state
// (threads, spawn_ranks, shm): 10 steps in one go against 5 steps, save,
// load under the same or another TP x DP layout, 5 more steps. The losses of
// steps 6-10 equal the continuous run's bit for bit when the layout is
// unchanged and within float32 rounding when it changed (TP=2 x DP=2 saved,
// loaded at TP=1 x DP=1, TP=4 x DP=1, TP=1 x DP=4).

#include "checkpoint_util.h"
#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kModel = 6;
constexpr int64_t kFfn = 12;
constexpr int64_t kBatch = 8;
constexpr int kSteps = 10;

struct Layout {
  int tp, dp;
  int world() const { return tp * dp; }
  std::string str() const { return "TP=" + std::to_string(tp) + " x DP=" + std::to_string(dp); }
};

struct Data {
  at::Tensor x, y;  // [steps, batch, model]
};
Data data() { return {seeded_randn({kSteps, kBatch, kModel}, 1), seeded_randn({kSteps, kBatch, kModel}, 2)}; }

// Trains steps [from, to) under `layout`; loads `load_root` first when given,
// saves under `save_root` after step `save_after` when given. Returns each
// step's loss (mean over the data-parallel ranks), from rank 0.
std::vector<double> train(const Layout& layout, int from, int to, const std::string& load_root = "",
                          const std::string& save_root = "", int save_after = -1) {
  const auto d = data();
  std::vector<double> losses;
  spawn_ranks(
      layout.world(),
      [&](Group& world) {
        auto state = commgrad::make_model_parallel(layout.tp, 1, world);
        tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(42));
        optim::ZeroOptimizer zero(
            mlp,
            [](auto shards) { return std::make_unique<torch::optim::AdamW>(shards, torch::optim::AdamWOptions(0.01)); },
            optim::ZeroOptimizerOptions(dp::DistributedDataParallelOptions(state.data_parallel_group())
                                            .bucket_cap_mb(0.0002)
                                            .first_bucket_cap_mb(0.0001))
                .stage(2)
                .max_grad_norm(0.5)
                .tensor_parallel_group(state.tensor_parallel_group()));
        if (!load_root.empty()) {
          auto model = checkpoint::module_pieces(*mlp);
          auto optim = checkpoint::optimizer_load_pieces(zero);
          auto pieces = model;
          pieces.insert(pieces.end(), optim.begin(), optim.end());
          const auto result = checkpoint::load(load_root, pieces);
          // The load pieces of the optimizer are its own; hand them over.
          std::vector<checkpoint::TensorPiece> loaded(pieces.begin() + model.size(), pieces.end());
          checkpoint::restore_optimizer(zero, loaded, result);
          EXPECT_EQ(result.step, from);
          EXPECT_EQ(result.metadata.at("layout"), "TP=2 x DP=2");
          EXPECT_EQ(zero.step_count(), from);
        }
        const int dp = state.data_parallel_rank();
        for (int k = from; k < to; ++k) {
          zero.zero_grad();
          auto loss = torch::mse_loss(mlp->forward(d.x[k].chunk(layout.dp, 0)[dp]), d.y[k].chunk(layout.dp, 0)[dp]);
          loss.backward();
          zero.step();
          auto mean = ops::raw::all_reduce(loss.detach().reshape({1}), ops::AllReduceOptions().op(ReduceOp::kAvg),
                                           state.data_parallel_group())
                          .wait();
          if (world.rank() == 0) losses.push_back(mean.item<double>());
          if (k + 1 == save_after) {
            auto pieces = checkpoint::module_pieces(*mlp);
            auto optim = checkpoint::optimizer_pieces(zero);
            pieces.insert(pieces.end(), optim.begin(), optim.end());
            checkpoint::save(save_root, k + 1, pieces, {{"layout", layout.str()}});
          }
        }
      },
      SpawnOptions().backend("shm"));
  return losses;
}

TEST(ZeroResume, SameLayoutIsBitForBitAndOtherLayoutsFollowTheCurve) {
  const Layout saved{2, 2};
  const auto continuous = train(saved, 0, kSteps);
  ASSERT_EQ(continuous.size(), static_cast<size_t>(kSteps));
  TempRoot root("resume");
  const auto first = train(saved, 0, 5, "", root.str(), 5);
  for (int k = 0; k < 5; ++k) EXPECT_EQ(first[k], continuous[k]) << "step " << k + 1;
  for (const Layout& layout : {Layout{2, 2}, Layout{1, 1}, Layout{4, 1}, Layout{1, 4}}) {
    SCOPED_TRACE("loaded at " + layout.str());
    const auto resumed = train(layout, 5, kSteps, root.str());
    ASSERT_EQ(resumed.size(), 5u);
    for (int k = 0; k < 5; ++k) {
      if (layout.tp == saved.tp && layout.dp == saved.dp) {
        EXPECT_EQ(resumed[k], continuous[5 + k]) << "step " << 6 + k;
      } else {
        EXPECT_NEAR(resumed[k], continuous[5 + k], 1e-5 * std::abs(continuous[5 + k])) << "step " << 6 + k;
      }
    }
  }
}

TEST(ZeroResume, AModelOnlyCheckpointHasNoOptimizerState) {
  TempRoot root("model-only");
  spawn_ranks(
      2,
      [&](Group& world) {
        auto state = commgrad::make_model_parallel(1, 1, world);
        tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(42));
        optim::ZeroOptimizer zero(
            mlp,
            [](auto shards) { return std::make_unique<torch::optim::Adam>(shards, torch::optim::AdamOptions(0.01)); },
            optim::ZeroOptimizerOptions(dp::DistributedDataParallelOptions(world)));
        checkpoint::save(root.str(), 1, checkpoint::module_pieces(*mlp));
        auto pieces = checkpoint::optimizer_load_pieces(zero);
        try {
          checkpoint::load(root.str(), pieces);
          ADD_FAILURE() << "loading optimizer state from a model-only checkpoint did not fail";
        } catch (const std::exception& e) {
          EXPECT_THAT(e.what(), HasSubstr("has no tensor 'optim/step', which this rank loads"));
        }
      },
      SpawnOptions().backend("shm"));
}

}  // namespace
}  // namespace commgrad::testing
