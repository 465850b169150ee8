// Initialisation seeds of the tensor-parallel layers (random.h: draw_seed,
// resolve_seed). A layer built without .seed() takes its seed from
// LibTorch's default CPU generator, like torch::nn::Linear: two such layers
// differ, torch::manual_seed(k) makes them reproducible, and every rank of
// the group builds shards of the same full layer: the one built at TP = 1
// after torch::manual_seed(k).
//
// The ranks of spawn_ranks() are threads, and threads share LibTorch's one
// default generator: each rank's draw is a different number, which is what a
// rank whose generator has drifted (it drew other numbers before) sees in a
// multi-process job. So only the broadcast of group rank 0's draw can make
// the shards agree. The tests order the threads so that rank 0 draws first
// (its draw is then the first after torch::manual_seed(k), as at TP = 1), and
// one other rank draws extra numbers before building.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <ATen/CPUGeneratorImpl.h>

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <thread>

namespace commgrad::testing {
namespace {

using Build = std::function<std::shared_ptr<torch::nn::Module>(const Group&)>;
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

// Layers without a seed, built over `g`; sizes divide by 1, 2 and 4.
const std::vector<std::pair<std::string, Build>>& unseeded_layers() {
  static const std::vector<std::pair<std::string, Build>> layers = {
      {"ColumnParallelLinear",
       [](const Group& g) { return tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(8, 12, g)).ptr(); }},
      {"RowParallelLinear",
       [](const Group& g) {
         return tp::RowParallelLinear(tp::RowParallelLinearOptions(12, 8, g).input_is_parallel(true)).ptr();
       }},
      {"VocabParallelEmbedding",
       [](const Group& g) { return tp::VocabParallelEmbedding(tp::VocabParallelEmbeddingOptions(16, 4, g)).ptr(); }},
      {"ParallelMLP", [](const Group& g) { return tp::ParallelMLP(tp::ParallelMLPOptions(8, 16, g)).ptr(); }},
      {"ParallelTransformerLayer",
       [](const Group& g) {
         return tp::ParallelTransformerLayer(tp::ParallelTransformerLayerOptions(16, 4, 8, g)).ptr();
       }},
  };
  return layers;
}

bool same_state(const StateDict& a, const StateDict& b) {
  if (a.size() != b.size()) return false;
  for (const auto& item : a) {
    const at::Tensor* other = b.find(item.key());
    if (other == nullptr || !torch::equal(item.value(), *other)) return false;
  }
  return true;
}

at::Tensor default_generator_state() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

// Blocks until LibTorch's default generator has left `state` (some thread
// drew from it); false after 10 s.
bool wait_for_a_draw(const at::Tensor& state) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (torch::equal(default_generator_state(), state)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(TpSeeds, LayersWithoutASeedDiffer) {
  // Before the fix every unseeded layer used seed 0: two were identical.
  const Group g = commgrad::self_group();
  for (const auto& [name, build] : unseeded_layers()) {
    SCOPED_TRACE(name);
    const auto a = build(g), b = build(g);
    EXPECT_FALSE(same_state(tp::gather_full_state_dict(*a), tp::gather_full_state_dict(*b)));
  }
  // ... in torch::nn::Linear's constructor form, the group coming from the
  // parallel state (a world of one: new_group then connects to no peer) ...
  spawn_ranks(1, [](Group& world) {
    commgrad::ScopedParallelState scope(commgrad::make_model_parallel(1, 1, world));
    tp::ColumnParallelLinear a(64, 256), b(64, 256);
    EXPECT_FALSE(torch::equal(a->weight, b->weight));
  });
  // ... and at TP = 2, where the seeds are broadcast.
  spawn_ranks(2, [](Group& g) {
    tp::ColumnParallelLinear a(tp::ColumnParallelLinearOptions(64, 256, g));
    tp::ColumnParallelLinear b(tp::ColumnParallelLinearOptions(64, 256, g));
    EXPECT_FALSE(torch::equal(tp::gather_full_state_dict(*a)["weight"], tp::gather_full_state_dict(*b)["weight"]));
  });
}

TEST(TpSeeds, ManualSeedMakesThemReproducible) {
  const Group g = commgrad::self_group();
  for (const auto& [name, build] : unseeded_layers()) {
    SCOPED_TRACE(name);
    torch::manual_seed(7);
    const auto first = tp::gather_full_state_dict(*build(g));
    torch::manual_seed(7);
    const auto again = tp::gather_full_state_dict(*build(g));
    torch::manual_seed(8);
    const auto other = tp::gather_full_state_dict(*build(g));
    EXPECT_TRUE(same_state(first, again));
    EXPECT_FALSE(same_state(first, other));
  }
  // The drawn seed is kept in the options: the layer holds init_linear(seed).
  torch::manual_seed(7);
  tp::ColumnParallelLinear fc(tp::ColumnParallelLinearOptions(8, 12, g));
  ASSERT_TRUE(fc->options.seed().has_value());
  EXPECT_TRUE(torch::equal(fc->weight, tp::init_linear(8, 12, true, *fc->options.seed()).weight));
  torch::manual_seed(7);
  EXPECT_EQ(tp::draw_seed(), *fc->options.seed());
  // The references draw their seed as their parallel layers do.
  torch::manual_seed(9);
  tp::ParallelMLP mlp(tp::ParallelMLPOptions(8, 16, g));
  torch::manual_seed(9);
  tp::MLPReference ref(tp::ParallelMLPOptions(8, 16));
  EXPECT_TRUE(same_state(tp::gather_full_state_dict(*mlp), ref->named_parameters()));
  torch::manual_seed(9);
  tp::ParallelTransformerLayer layer(tp::ParallelTransformerLayerOptions(16, 4, 8, g));
  torch::manual_seed(9);
  tp::TransformerLayerReference layer_ref(tp::ParallelTransformerLayerOptions(16, 4, 8));
  EXPECT_TRUE(same_state(tp::gather_full_state_dict(*layer), layer_ref->named_parameters()));
}

TEST(TpSeeds, CloneAndResetKeepTheDrawnSeed) {
  // The drawn seed is in the options: clone() (which calls reset()) and
  // reset_parameters() rebuild the same weights and draw nothing, so cloning
  // on one rank cannot start a broadcast the other ranks do not join.
  const Group g = commgrad::self_group();
  tp::ParallelMLP mlp(tp::ParallelMLPOptions(8, 16, g));
  const at::Tensor before = default_generator_state();
  auto copy = std::dynamic_pointer_cast<tp::ParallelMLPImpl>(mlp->clone());
  ASSERT_TRUE(copy);
  mlp->fc1->reset_parameters();
  EXPECT_TRUE(torch::equal(default_generator_state(), before));
  EXPECT_TRUE(same_state(tp::gather_full_state_dict(*copy), tp::gather_full_state_dict(*mlp)));
  ASSERT_TRUE(copy->options.seed().has_value() && mlp->options.seed().has_value());
  EXPECT_EQ(*copy->options.seed(), *mlp->options.seed());
}

class TpSeedsAcrossRanks : public ::testing::TestWithParam<int> {};

TEST_P(TpSeedsAcrossRanks, ShardsOfTheUnsplitLayerAfterManualSeed) {
  const int n = GetParam();
  for (const auto& [name, build] : unseeded_layers()) {
    SCOPED_TRACE(name);
    torch::manual_seed(1234);
    const StateDict unsplit = tp::gather_full_state_dict(*build(commgrad::self_group()));
    torch::manual_seed(1234);  // on every rank: the ranks share this generator
    const at::Tensor seeded = default_generator_state();
    std::vector<StateDict> gathered(n);
    const Build& make = build;
    spawn_ranks(n, [&](Group& g) {
      if (g.rank() != 0) {
        ASSERT_TRUE(wait_for_a_draw(seeded)) << "rank 0 never drew its seed";
      }
      if (g.rank() == n - 1) torch::rand({5});  // this rank's generator drifts
      gathered[g.rank()] = tp::gather_full_state_dict(*make(g));
    });
    for (int r = 0; r < n; ++r) EXPECT_TRUE(same_state(gathered[r], unsplit)) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(TpSizes, TpSeedsAcrossRanks, ::testing::Values(2, 4),
                         [](const auto& info) { return c10::str("tp", info.param); });

TEST(TpSeeds, AnExplicitSeedDrawsNothing) {
  // Neither draws from the generator nor communicates (a group of one would
  // skip the broadcast anyway; the generator shows that nothing was drawn).
  const Group one = commgrad::self_group();
  const at::Tensor before = default_generator_state();
  tp::ColumnParallelLinear fc(tp::ColumnParallelLinearOptions(8, 12, one).seed(5));
  tp::VocabParallelEmbedding emb(tp::VocabParallelEmbeddingOptions(16, 4, one).seed(5));
  tp::ParallelTransformerLayer layer(tp::ParallelTransformerLayerOptions(16, 4, 8, one).seed(5));
  EXPECT_TRUE(torch::equal(default_generator_state(), before));
  ASSERT_TRUE(fc->options.seed().has_value());
  EXPECT_EQ(*fc->options.seed(), 5u);
  EXPECT_TRUE(torch::equal(fc->weight, tp::init_linear(8, 12, true, 5).weight));
  EXPECT_TRUE(torch::equal(emb->weight, tp::init_embedding(16, 4, 5)));
  // At TP = 2, with the ranks at different places in the generator: each
  // rank's shard is the slice of the layer built from the seed.
  spawn_ranks(2, [](Group& g) {
    if (g.rank() == 1) torch::rand({3});
    tp::ColumnParallelLinear fc(tp::ColumnParallelLinearOptions(8, 12, g).seed(5));
    const auto full = tp::gather_full_state_dict(*fc);
    EXPECT_TRUE(torch::equal(full["weight"], tp::init_linear(8, 12, true, 5).weight));
    EXPECT_TRUE(torch::equal(full["bias"], tp::init_linear(8, 12, true, 5).bias));
    tp::ParallelMLP mlp(tp::ParallelMLPOptions(8, 16, g).seed(6));
    tp::MLPReference ref(tp::ParallelMLPOptions(8, 16).seed(6));
    EXPECT_TRUE(same_state(tp::gather_full_state_dict(*mlp), ref->named_parameters()));
  });
}

}  // namespace
}  // namespace commgrad::testing
