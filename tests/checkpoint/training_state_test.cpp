// One-call training state (checkpoint/training_state.h), on threads:
// - save_training_state at TP=2 x DP=2, load_training_state at TP=2 x DP=2,
//   TP=1 x DP=4 and TP=4: the following losses follow the continuous run;
// - the third silent mistake: pieces taken before the ZeroOptimizer
//   re-pointed the parameters are an error at save and at load, on every rank
//   (load used to report success and leave the weights at their initial values);
// - a weights-only load of a training checkpoint needs no strict(false), and
//   still finds a model tensor nobody loads.

#include "checkpoint_util.h"
#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing {
namespace {

constexpr int64_t kModel = 4, kFfn = 8, kBatch = 8;
constexpr int kSteps = 6, kSaveAt = 3;

struct Data {
  at::Tensor x, y;
};
Data data() { return {seeded_randn({kSteps, kBatch, kModel}, 1), seeded_randn({kSteps, kBatch, kModel}, 2)}; }

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<at::Tensor> shards) {
  return std::make_unique<torch::optim::AdamW>(shards, torch::optim::AdamWOptions(0.01));
}

// Steps [from, to) at TP = tp on 4 ranks, the groups from the layout; loads
// `load_root` first, saves after step kSaveAt under `save_root`. Losses (mean
// over DP) from rank 0.
std::vector<double> train(int tp, int from, int to, const std::string& load_root, const std::string& save_root) {
  const auto d = data();
  std::vector<double> losses;
  spawn_ranks(
      4,
      [&](Group& world) {
        ScopedParallelState scope(make_model_parallel(tp, 1, world));
        const auto state = parallel_state();
        tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn).seed(42));
        optim::ZeroOptimizer zero(mlp, adamw, optim::ZeroOptimizerOptions().stage(2).max_grad_norm(0.5));
        if (!load_root.empty()) {
          const auto loaded = checkpoint::load_training_state(load_root, *mlp, zero);
          EXPECT_EQ(loaded.step, from);
          EXPECT_EQ(loaded.metadata.at("note"), "saved at TP=2");
          EXPECT_EQ(zero.step_count(), from);
        }
        const int dp = state.data_parallel_rank(), n = state.data_parallel_size();
        for (int k = from; k < to; ++k) {
          zero.zero_grad();
          auto loss = torch::mse_loss(mlp->forward(d.x[k].chunk(n, 0)[dp]), d.y[k].chunk(n, 0)[dp]);
          loss.backward();
          zero.step();
          auto mean = ops::raw::all_reduce(loss.detach().reshape({1}), ops::AllReduceOptions().op(ReduceOp::kAvg),
                                           state.data_parallel_group())
                          .wait();
          if (world.rank() == 0) losses.push_back(mean.item<double>());
          if (k + 1 == kSaveAt && !save_root.empty()) {
            checkpoint::save_training_state(save_root, k + 1, *mlp, zero, {{"note", "saved at TP=2"}});
          }
        }
      },
      SpawnOptions().backend("shm"));
  return losses;
}

TEST(TrainingState, OneCallResumesAtOtherLayouts) {
  TempRoot root("training-state");
  const auto continuous = train(2, 0, kSteps, "", root.str());
  ASSERT_EQ(continuous.size(), static_cast<size_t>(kSteps));
  for (int tp : {2, 1, 4}) {
    SCOPED_TRACE("resumed at TP=" + std::to_string(tp));
    const auto resumed = train(tp, kSaveAt, kSteps, root.str(), "");
    ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps - kSaveAt));
    for (int k = 0; k < kSteps - kSaveAt; ++k) {
      if (tp == 2) {
        EXPECT_EQ(resumed[k], continuous[kSaveAt + k]) << "step " << kSaveAt + k + 1;
      } else {
        EXPECT_NEAR(resumed[k], continuous[kSaveAt + k], 1e-5 * std::abs(continuous[kSaveAt + k]));
      }
    }
  }
}

TEST(TrainingState, PiecesTakenBeforeTheOptimizerAreAnError) {
  TempRoot root("stale");
  spawn_ranks(
      4,
      [&](Group& world) {
        const auto state = make_model_parallel(2, 1, world);
        tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(42));
        const auto stale = checkpoint::module_pieces(*mlp);  // the natural order: pieces, then the optimizer
        optim::ZeroOptimizer zero(mlp, adamw, optim::ZeroOptimizerOptions(state.data_parallel_group()));
        const std::string want = "no longer views the parameter it was taken from";
        expect_error([&] { checkpoint::save(root.str(), 1, stale); }, {"checkpoint::save", want});
        checkpoint::save(root.str(), 1, checkpoint::module_pieces(*mlp));  // taken now: fine
        expect_error([&] { checkpoint::load(root.str(), stale); },
                     {want, "save_training_state() / load_training_state()"});
      },
      SpawnOptions().backend("shm"));
}

TEST(TrainingState, WeightsOnlyLoadOfATrainingCheckpoint) {
  TempRoot root("weights-only");
  torch::OrderedDict<std::string, at::Tensor> saved;
  spawn_ranks(
      4,
      [&](Group& world) {
        ScopedParallelState scope(make_model_parallel(2, 1, world));
        tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn).seed(7));
        optim::ZeroOptimizer zero(mlp, adamw);
        mlp->forward(torch::ones({2, kModel})).sum().backward();
        zero.step();
        checkpoint::save_training_state(root.str(), 1, *mlp, zero);
        const auto full = tp::gather_full_state_dict(*mlp);
        if (world.rank() == 0) saved = full;
      },
      SpawnOptions().backend("shm"));
  spawn_ranks(1, [&](Group&) {
    tp::ParallelMLP fresh(tp::ParallelMLPOptions(kModel, kFfn, self_group()).seed(1));
    checkpoint::load_model_weights(root.str(), *fresh);
    for (const auto& p : fresh->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), saved[p.key()])) << p.key();
    }
    // load() itself is strict about the model's section only.
    checkpoint::load(root.str(), checkpoint::module_pieces(*fresh));
    // A model without biases leaves the checkpoint's biases unloaded: still an error.
    tp::ParallelMLP no_bias(tp::ParallelMLPOptions(kModel, kFfn, self_group()).bias(false));
    expect_error([&] { checkpoint::load_model_weights(root.str(), *no_bias); },
                 {"that no rank loads: 'model/fc1.bias', 'model/fc2.bias'"});
  });
}

}  // namespace
}  // namespace commgrad::testing
