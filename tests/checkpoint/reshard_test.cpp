// Checkpoints of real tensor-parallel modules: saved at TP=2 x DP=2, loaded
// at TP=1 x DP=1, TP=4 x DP=1, TP=1 x DP=4 (and TP=2 x DP=2 again), each
// compared against the unsplit model (tp::gather_full_state_dict). The model
// holds a column-parallel, a row-parallel, a strided (fused-QKV-like)
// column-parallel layer, replicated biases and a buffer. And the RNG
// tracker's streams: restored exactly under the same layout, and by the
// stated rule under another TP size.

#include "checkpoint/checkpoint_util.h"
#include "harness/spawn_ranks.h"

#include <commgrad/checkpoint.h>
#include <commgrad/tp.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

namespace commgrad::testing {
namespace {

struct NetImpl : torch::nn::Module {
  NetImpl(const Group& tp_group, uint64_t seed) {
    mlp = register_module("mlp", tp::ParallelMLP(tp::ParallelMLPOptions(8, 16, tp_group).seed(seed)));
    qkv = register_module(
        "qkv", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(8, 24, tp_group).stride(3).seed(seed + 7)));
    steps = register_buffer("steps", torch::full({2}, static_cast<double>(seed)));
  }
  tp::ParallelMLP mlp{nullptr};
  tp::ColumnParallelLinear qkv{nullptr};
  torch::Tensor steps;
};
TORCH_MODULE(Net);

TEST(CheckpointModules, SavedAtTp2Dp2LoadsAtEveryOtherLayout) {
  TempRoot root("modules");
  std::map<std::string, at::Tensor> expected;
  spawn_ranks(4, [&](Group& world) {
    auto state = commgrad::make_model_parallel(2, 1, world);
    Net net(state.tensor_parallel_group(), 11);
    const auto full = tp::gather_full_state_dict(*net);
    if (world.rank() == 0) {
      for (const auto& item : full) expected[item.key()] = item.value();
    }
    const auto pieces = checkpoint::module_pieces(*net);
    // qkv.weight (stride 3) is three boxes per rank.
    EXPECT_EQ(std::count_if(pieces.begin(), pieces.end(), [](const auto& p) { return p.name == "model/qkv.weight"; }),
              3);
    checkpoint::save(root.str(), 10, pieces, {{"layout", "tp2 x dp2"}}, {}, world);
  });
  // Only DP rank 0 of each TP rank wrote: two shard files.
  EXPECT_TRUE(fs::exists(root.path() / "step-00000010" / "rank-00001.safetensors"));
  EXPECT_FALSE(fs::exists(root.path() / "step-00000010" / "rank-00002.safetensors"));
  ASSERT_EQ(expected.size(), 7u);  // mlp.fc1 w/b, mlp.fc2 w/b, qkv w/b, steps

  struct Layout {
    int tp;
    int world;
  };
  for (const Layout layout : {Layout{1, 1}, Layout{4, 4}, Layout{1, 4}, Layout{2, 2}}) {
    SCOPED_TRACE("TP=" + std::to_string(layout.tp) + " x DP=" + std::to_string(layout.world / layout.tp));
    spawn_ranks(layout.world, [&](Group& world) {
      auto state = commgrad::make_model_parallel(layout.tp, 1, world);
      Net net(state.tensor_parallel_group(), 99);
      const auto result = checkpoint::load(root.str(), checkpoint::module_pieces(*net), {}, world);
      EXPECT_EQ(result.metadata.at("layout"), "tp2 x dp2");
      // This rank's own shard is its part of the unsplit tensor ...
      const auto specs = tp::shard_specs(*net);
      for (const auto& p : net->named_parameters()) {
        const auto& s = specs[p.key()];
        const int n = s.spec.is_partitioned() ? s.group.size() : 1;
        EXPECT_TRUE(at::equal(p.value(), tp::shard_tensor(expected.at(p.key()), s.spec, s.group.rank(), n)))
            << p.key() << " on rank " << world.rank();
      }
      // ... and together they are the unsplit model.
      for (const auto& item : tp::gather_full_state_dict(*net)) {
        EXPECT_TRUE(at::equal(item.value(), expected.at(item.key()))) << item.key();
      }
    });
  }
}

at::Tensor draw(const at::Generator& g) { return at::rand({4}, g, at::TensorOptions()); }

TEST(CheckpointRng, RestoredExactlyUnderTheSameLayoutAndByTheRuleUnderAnother) {
  TempRoot root("rng");
  std::mutex mu;
  std::map<int, at::Tensor> next_default;  // by world rank of the save
  std::map<int, at::Tensor> next_parallel;
  spawn_ranks(4, [&](Group& world) {
    auto state = commgrad::make_model_parallel(2, 1, world);
    tp::RngTracker tracker;
    tp::model_parallel_manual_seed(1234, state.tensor_parallel_group(), tracker);
    draw(tracker.default_generator());
    draw(tracker.generator(tp::kModelParallelRng));
    checkpoint::save(root.str(), 1, checkpoint::rng_pieces(tracker, state.tensor_parallel_group()), {}, {}, world);
    std::lock_guard<std::mutex> lock(mu);
    next_default[world.rank()] = draw(tracker.default_generator());
    next_parallel[world.rank()] = draw(tracker.generator(tp::kModelParallelRng));
  });
  // The same layout: every stream exactly.
  spawn_ranks(4, [&](Group& world) {
    auto state = commgrad::make_model_parallel(2, 1, world);
    tp::RngTracker tracker;
    tp::model_parallel_manual_seed(5, state.tensor_parallel_group(), tracker);
    auto pieces = checkpoint::rng_pieces(tracker, state.tensor_parallel_group());
    const auto result = checkpoint::load(root.str(), pieces, {}, world);
    EXPECT_THAT(checkpoint::restore_rng(tracker, pieces, result),
                ::testing::ElementsAre(tp::kDefaultRng, tp::kModelParallelRng));
    EXPECT_TRUE(at::equal(draw(tracker.default_generator()), next_default.at(world.rank())));
    EXPECT_TRUE(at::equal(draw(tracker.generator(tp::kModelParallelRng)), next_parallel.at(world.rank())));
  });
  // TP=4: the default stream everywhere; TP ranks 0 and 1 get their saved
  // stream, TP ranks 2 and 3 (absent from the save) keep their own seed.
  spawn_ranks(4, [&](Group& world) {
    auto state = commgrad::make_model_parallel(4, 1, world);
    const Group& tp_group = state.tensor_parallel_group();
    tp::RngTracker tracker;
    tp::model_parallel_manual_seed(5, tp_group, tracker);
    tp::RngTracker fresh;
    tp::model_parallel_manual_seed(5, tp_group, fresh);
    auto pieces = checkpoint::rng_pieces(tracker, tp_group);
    const auto result = checkpoint::load(root.str(), pieces, {}, world);
    checkpoint::restore_rng(tracker, pieces, result);
    EXPECT_TRUE(at::equal(draw(tracker.default_generator()), next_default.at(0)));
    const auto mine = draw(tracker.generator(tp::kModelParallelRng));
    if (tp_group.rank() < 2) {
      EXPECT_TRUE(result.skipped.empty());
      EXPECT_TRUE(at::equal(mine, next_parallel.at(tp_group.rank())));
    } else {
      EXPECT_THAT(result.skipped, ::testing::ElementsAre("rng/model-parallel/tp" + std::to_string(tp_group.rank())));
      EXPECT_TRUE(at::equal(mine, draw(fresh.generator(tp::kModelParallelRng))));
    }
  });
  // TP=1 on one rank: a strict load (the stream of TP rank 1 is optional).
  spawn_ranks(1, [&](Group& world) {
    tp::RngTracker tracker;
    tp::model_parallel_manual_seed(5, world, tracker);
    auto pieces = checkpoint::rng_pieces(tracker, world);
    checkpoint::restore_rng(tracker, pieces, checkpoint::load(root.str(), pieces, {}, world));
    EXPECT_TRUE(at::equal(draw(tracker.generator(tp::kModelParallelRng)), next_parallel.at(0)));
  });
}

}  // namespace
}  // namespace commgrad::testing
