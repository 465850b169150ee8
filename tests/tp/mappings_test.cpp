// Parallel state (group layout, accessors, errors) and the seven Family 2
// mappings, forward and backward, with closed-form values at TP 1, 2, 3, 4.
//
// Rank r's tensors are filled with r + 1 (or an arange), so each expected
// value is a small formula: a sum over ranks is n (n + 1) / 2, a gathered
// tensor has chunk k equal to k + 1.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

// ~~~ parallel state ~~~

std::vector<int> ranks_of(const Group& g) { return g.ranks(); }

TEST(TpParallelState, MegatronRankOrderTp2Pp1) {
  spawn_ranks(4, [](Group& world) {
    auto s = commgrad::make_model_parallel(2, 1, world);
    const int r = world.rank();
    EXPECT_EQ(ranks_of(s.tensor_parallel_group()), (r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    EXPECT_EQ(ranks_of(s.data_parallel_group()), (r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3}));
    EXPECT_EQ(ranks_of(s.pipeline_parallel_group()), std::vector<int>{r});
    EXPECT_EQ(s.tensor_parallel_rank(), r % 2);
    EXPECT_EQ(s.tensor_parallel_size(), 2);
    EXPECT_EQ(s.data_parallel_rank(), r / 2);
    EXPECT_EQ(s.data_parallel_size(), 2);
    EXPECT_EQ(s.pipeline_parallel_size(), 1);
    EXPECT_EQ(s.tensor_parallel_group().name(), c10::str("tp", r / 2));
    // The TP group works: a sum over it.
    auto y = tp::reduce_from_tp_region(torch::full({2}, static_cast<float>(r)), s.tensor_parallel_group());
    EXPECT_TRUE(torch::equal(y, torch::full({2}, r < 2 ? 1.f : 5.f)));
  });
}

TEST(TpParallelState, MegatronRankOrderTp2Pp2) {
  // The layout of parallel_state.h's comment, at W = 4.
  spawn_ranks(4, [](Group& world) {
    auto s = commgrad::make_model_parallel(2, 2, world);
    const int r = world.rank();
    EXPECT_EQ(ranks_of(s.tensor_parallel_group()), (r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    EXPECT_EQ(ranks_of(s.pipeline_parallel_group()), (r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3}));
    EXPECT_EQ(ranks_of(s.data_parallel_group()), std::vector<int>{r});
    EXPECT_EQ(s.describe(), c10::str("tp ", r % 2, "/2 (gloo) pp ", r / 2, "/2 (gloo) dp 0/1 (gloo) (world 4, gloo)"));
    EXPECT_EQ(s.embedding_group(), s.pipeline_parallel_group());  // two stages: both hold the embedding
  });
}

TEST(TpParallelState, EmbeddingGroupsJoinTheFirstAndLastStage) {
  // W = 6, TP = 1, PP = 3: pipelines [0, 2, 4] and [1, 3, 5]; the middle stage has none.
  spawn_ranks(6, [](Group& world) {
    auto s = commgrad::make_model_parallel(1, 3, world);
    const int r = world.rank();
    if (r == 2 || r == 3) {
      EXPECT_FALSE(s.embedding_group().defined());
    } else {
      EXPECT_EQ(ranks_of(s.embedding_group()), (r % 2 == 0 ? std::vector<int>{0, 4} : std::vector<int>{1, 5}));
      // It works: the first stage's rank is its rank 0.
      auto sum = tp::reduce_from_tp_region(torch::full({1}, static_cast<float>(r)), s.embedding_group());
      EXPECT_EQ(sum.item<float>(), r % 2 == 0 ? 4.f : 6.f);
      EXPECT_EQ(s.embedding_group().rank(), r < 2 ? 0 : 1);
    }
  });
  spawn_ranks(2, [](Group& world) {
    auto s = commgrad::make_model_parallel(1, 1, world);  // no pipeline: a group of one
    EXPECT_EQ(ranks_of(s.embedding_group()), std::vector<int>{world.rank()});
  });
}

TEST(TpParallelState, ContextAndExpertGroupsInMegatronOrder) {
  // The second layout of parallel_state.h's comment: W = 8, tp = 2, cp = 2,
  // dp = 2, ep = 2.
  spawn_ranks(8, [](Group& world) {
    auto s = commgrad::make_model_parallel(
        commgrad::ModelParallelOptions(2).context_parallel_size(2).expert_parallel_size(2), world);
    const int r = world.rank();
    const int t = r % 2, c = (r / 2) % 2, d = r / 4;
    EXPECT_EQ(ranks_of(s.tensor_parallel_group()), (std::vector<int>{r - t, r - t + 1}));
    EXPECT_EQ(ranks_of(s.context_parallel_group()), (std::vector<int>{r - 2 * c, r - 2 * c + 2}));
    EXPECT_EQ(ranks_of(s.data_parallel_group()), (std::vector<int>{r - 4 * d, r - 4 * d + 4}));
    EXPECT_EQ(ranks_of(s.data_context_parallel_group()), (std::vector<int>{t, t + 2, t + 4, t + 6}));
    EXPECT_EQ(ranks_of(s.expert_parallel_group()), (std::vector<int>{r - 2 * c, r - 2 * c + 2}));
    EXPECT_EQ(ranks_of(s.expert_data_parallel_group()), (std::vector<int>{r - 4 * d, r - 4 * d + 4}));
    EXPECT_EQ(ranks_of(s.pipeline_parallel_group()), std::vector<int>{r});
    EXPECT_EQ(s.context_parallel_rank(), c);
    EXPECT_EQ(s.expert_parallel_size(), 2);
    EXPECT_EQ(s.context_parallel_group().name(), c10::str("cp", r / 4 * 2 + t));
    {
      commgrad::ScopedParallelState scope(s);
      EXPECT_EQ(commgrad::default_data_parallel_group(), s.data_context_parallel_group());
      EXPECT_EQ(commgrad::default_expert_data_parallel_group(), s.expert_data_parallel_group());
    }
    // The data-context group works: a sum over it.
    auto y = tp::reduce_from_tp_region(torch::full({1}, static_cast<float>(r)), s.data_context_parallel_group());
    EXPECT_EQ(y.item<float>(), 4.f * t + 12.f);
  });
}

TEST(TpParallelState, ExpertGroupsSpanContextAndDataRanks) {
  // W = 8, cp = 2, dp = 4, ep = 4: the data-context group is the world; expert
  // groups are its first and last four ranks, expert-data groups pairs four apart.
  spawn_ranks(8, [](Group& world) {
    auto s = commgrad::make_model_parallel(
        commgrad::ModelParallelOptions(1).context_parallel_size(2).expert_parallel_size(4), world);
    const int r = world.rank();
    EXPECT_EQ(ranks_of(s.data_context_parallel_group()).size(), 8u);
    EXPECT_EQ(ranks_of(s.expert_parallel_group()),
              (r < 4 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{4, 5, 6, 7}));
    EXPECT_EQ(ranks_of(s.expert_data_parallel_group()), (std::vector<int>{r % 4, r % 4 + 4}));
    EXPECT_EQ(ranks_of(s.context_parallel_group()), (std::vector<int>{r - r % 2, r - r % 2 + 1}));
    EXPECT_EQ(s.describe(), c10::str("tp 0/1 (gloo) pp 0/1 (gloo) dp ", r / 2, "/4 (gloo) cp ", r % 2, "/2 (gloo) ep ",
                                     r % 4, "/4 (gloo) (world 8, gloo)"));
  });
  spawn_ranks(2, [](Group& world) {
    // Without cp and ep: the context and expert groups are groups of one, the
    // data-context and expert-data groups the data-parallel group.
    auto s = commgrad::make_model_parallel(1, 1, world);
    EXPECT_EQ(s.context_parallel_size(), 1);
    EXPECT_EQ(s.expert_parallel_size(), 1);
    EXPECT_EQ(s.data_context_parallel_group(), s.data_parallel_group());
    EXPECT_EQ(s.expert_data_parallel_group(), s.data_parallel_group());
    EXPECT_THAT(
        error_of(
            [&] { commgrad::make_model_parallel(commgrad::ModelParallelOptions(1).expert_parallel_size(4), world); }),
        HasSubstr("expert_parallel_size (4) does not divide data_parallel_size (2) x context_parallel_size (1)"));
    EXPECT_THAT(error_of([&] {
                  commgrad::make_model_parallel(commgrad::ModelParallelOptions(1).context_parallel_size(0), world);
                }),
                HasSubstr("must be at least 1"));
  });
}

TEST(TpParallelState, TpEqualsWorld) {
  spawn_ranks(3, [](Group& world) {
    auto s = commgrad::make_model_parallel(3, 1, world);
    EXPECT_EQ(ranks_of(s.tensor_parallel_group()), (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(s.tensor_parallel_rank(), world.rank());
    EXPECT_EQ(s.data_parallel_size(), 1);
  });
}

TEST(TpParallelState, WorldNotDivisibleIsAClearError) {
  spawn_ranks(4, [](Group& world) {
    EXPECT_THAT(error_of([&] { commgrad::make_model_parallel(3, 1, world); }),
                HasSubstr("world size 4 is not divisible by tensor_parallel_size (3) x context_parallel_size (1) x "
                          "pipeline_parallel_size (1)"));
    EXPECT_THAT(error_of([&] { commgrad::make_model_parallel(2, 3, world); }), HasSubstr("not divisible"));
    EXPECT_THAT(error_of([&] { commgrad::make_model_parallel(0, 1, world); }), HasSubstr("must be at least 1"));
    // Nothing was created by the failed calls: a valid layout still works.
    auto s = commgrad::make_model_parallel(4, 1, world);
    EXPECT_EQ(s.tensor_parallel_size(), 4);
  });
}

TEST(TpParallelState, InitializeInstallsPerWorldAndTearsDown) {
  spawn_ranks(2, [](Group& world) {
    EXPECT_FALSE(commgrad::model_parallel_is_initialized());
    EXPECT_THAT(error_of([] { commgrad::tensor_parallel_group(); }), HasSubstr("model parallelism is not initialised"));
    EXPECT_THAT(error_of([] { tp::copy_to_tp_region(torch::ones({2})); }),
                HasSubstr("copy_to_tp_region: no tensor-parallel group given"));
    auto s = commgrad::initialize_model_parallel(2);
    EXPECT_TRUE(commgrad::model_parallel_is_initialized());
    EXPECT_EQ(commgrad::parallel_state(), s);
    EXPECT_EQ(commgrad::tensor_parallel_group(), s.tensor_parallel_group());
    EXPECT_EQ(commgrad::tensor_parallel_rank(), world.rank());
    EXPECT_EQ(commgrad::tensor_parallel_size(), 2);
    EXPECT_EQ(commgrad::data_parallel_size(), 1);
    EXPECT_THAT(error_of([] { commgrad::initialize_model_parallel(1); }), HasSubstr("already initialised"));
    // Layers and mappings default to the installed TP group.
    tp::ColumnParallelLinear fc(tp::ColumnParallelLinearOptions(3, 4));
    EXPECT_EQ(fc->options.group(), s.tensor_parallel_group());
    EXPECT_TRUE(torch::equal(tp::reduce_from_tp_region(torch::ones({2})), torch::full({2}, 2.f)));
    // A scoped state overrides the installed one for this thread.
    {
      commgrad::ScopedParallelState scope(commgrad::make_model_parallel(1, 1, world));
      EXPECT_EQ(commgrad::tensor_parallel_size(), 1);
    }
    EXPECT_EQ(commgrad::tensor_parallel_size(), 2);
    commgrad::destroy_model_parallel();
    EXPECT_FALSE(commgrad::model_parallel_is_initialized());
  });
}

TEST(TpParallelState, SingleRankGroupNeedsNoCollective) {
  auto g = commgrad::self_group();
  EXPECT_EQ(g.size(), 1);
  EXPECT_EQ(g.rank(), 0);
  EXPECT_EQ(g.name(), "single");
  EXPECT_EQ(commgrad::self_group(), g);  // one per thread
  EXPECT_TRUE(torch::equal(tp::reduce_from_tp_region(torch::ones({3}), g), torch::ones({3})));
}

// ~~~ mappings ~~~

class TpMappings : public ::testing::TestWithParam<int> {};

// x filled with `value`, as a leaf that requires grad.
torch::Tensor leaf(at::IntArrayRef sizes, double value) {
  return torch::full(sizes, value, torch::kDouble).requires_grad_(true);
}

// [rows, cols] with chunk k (of `n` along `dim`) filled with k + 1.
torch::Tensor chunk_ids(int64_t rows, int64_t cols, int n, int64_t dim) {
  auto out = torch::empty({rows, cols}, torch::kDouble);
  auto parts = out.chunk(n, dim);
  for (int k = 0; k < n; ++k) parts[k].fill_(k + 1);
  return out;
}

TEST_P(TpMappings, CopyToTpRegion) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int r = g.rank();
    auto x = leaf({2, 3}, 5);
    auto y = tp::copy_to_tp_region(x, g);
    EXPECT_TRUE(torch::equal(y, x));
    y.backward(torch::full({2, 3}, r + 1.0, torch::kDouble));
    EXPECT_TRUE(torch::equal(x.grad(), torch::full({2, 3}, n * (n + 1) / 2.0, torch::kDouble)));
  });
}

TEST_P(TpMappings, ReduceFromTpRegion) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int r = g.rank();
    auto x = leaf({2, 3}, r + 1);
    auto y = tp::reduce_from_tp_region(x, g);
    EXPECT_TRUE(torch::equal(y, torch::full({2, 3}, n * (n + 1) / 2.0, torch::kDouble)));
    EXPECT_TRUE(torch::equal(x.detach(), torch::full({2, 3}, r + 1.0, torch::kDouble)));  // input untouched
    auto gy = torch::arange(6, torch::kDouble).view({2, 3});
    y.backward(gy);
    EXPECT_TRUE(torch::equal(x.grad(), gy));  // identity
  });
}

TEST_P(TpMappings, ScatterToTpRegion) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int r = g.rank();
    auto x = torch::arange(2 * 3 * n, torch::kDouble).view({2, 3 * n}).requires_grad_(true);
    auto y = tp::scatter_to_tp_region(x, g);
    EXPECT_TRUE(torch::equal(y, x.detach().narrow(1, 3 * r, 3)));
    y.backward(torch::full({2, 3}, r + 1.0, torch::kDouble));
    EXPECT_TRUE(torch::equal(x.grad(), chunk_ids(2, 3 * n, n, 1)));  // all_gather of the grads
  });
}

TEST_P(TpMappings, GatherFromTpRegion) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int r = g.rank();
    auto x = leaf({2, 3}, r + 1);
    auto y = tp::gather_from_tp_region(x, g);
    EXPECT_TRUE(torch::equal(y, chunk_ids(2, 3 * n, n, 1)));
    auto gy = torch::arange(2 * 3 * n, torch::kDouble).view({2, 3 * n});
    y.backward(gy);
    EXPECT_TRUE(torch::equal(x.grad(), gy.narrow(1, 3 * r, 3)));  // own chunk
  });
}

TEST_P(TpMappings, ScatterToSequenceParallelRegion) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int r = g.rank();
    auto x = torch::arange(2 * n * 3, torch::kDouble).view({2 * n, 3}).requires_grad_(true);
    auto y = tp::scatter_to_sequence_parallel_region(x, g);
    EXPECT_TRUE(torch::equal(y, x.detach().narrow(0, 2 * r, 2)));
    y.backward(torch::full({2, 3}, r + 1.0, torch::kDouble));
    EXPECT_TRUE(torch::equal(x.grad(), chunk_ids(2 * n, 3, n, 0)));
  });
}

TEST_P(TpMappings, GatherFromSequenceParallelRegion) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int r = g.rank();
    auto x = leaf({2, 3}, r + 1);
    auto y = tp::gather_from_sequence_parallel_region(x, g);
    EXPECT_TRUE(torch::equal(y, chunk_ids(2 * n, 3, n, 0)));
    // backward: reduce_scatter SUM of every rank's gradient.
    auto gy = torch::arange(2 * n * 3, torch::kDouble).view({2 * n, 3}) * (r + 1);
    y.backward(gy);
    auto expected = torch::arange(2 * n * 3, torch::kDouble).view({2 * n, 3}).narrow(0, 2 * r, 2) * (n * (n + 1) / 2);
    EXPECT_TRUE(torch::equal(x.grad(), expected));
  });
}

TEST_P(TpMappings, ReduceScatterToSequenceParallelRegion) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int r = g.rank();
    auto base = torch::arange(2 * n * 3, torch::kDouble).view({2 * n, 3});
    auto x = (base * (r + 1)).requires_grad_(true);
    auto y = tp::reduce_scatter_to_sequence_parallel_region(x, g);
    EXPECT_TRUE(torch::equal(y, base.narrow(0, 2 * r, 2) * (n * (n + 1) / 2)));
    y.backward(torch::full({2, 3}, r + 1.0, torch::kDouble));
    EXPECT_TRUE(torch::equal(x.grad(), chunk_ids(2 * n, 3, n, 0)));  // all_gather
  });
}

TEST_P(TpMappings, NonContiguousInputsGiveTheSameResults) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    const int r = g.rank();
    // [4n, 6n] transposed: a non-contiguous [6n, 4n] with (r + 1) * arange values.
    auto base = (torch::arange(4 * n * 6 * n, torch::kDouble).view({4 * n, 6 * n}) * (r + 1)).t();
    ASSERT_FALSE(base.is_contiguous());
    auto contiguous = base.contiguous();
    using Fn = at::Tensor (*)(const at::Tensor&, const Group&);
    for (Fn fn : {Fn(tp::copy_to_tp_region), Fn(tp::reduce_from_tp_region), Fn(tp::scatter_to_tp_region),
                  Fn(tp::gather_from_tp_region), Fn(tp::scatter_to_sequence_parallel_region),
                  Fn(tp::gather_from_sequence_parallel_region), Fn(tp::reduce_scatter_to_sequence_parallel_region)}) {
      auto a = base.clone(at::MemoryFormat::Preserve).requires_grad_(true);  // still transposed
      auto b = contiguous.clone().requires_grad_(true);
      auto ya = fn(a, g);
      auto yb = fn(b, g);
      EXPECT_TRUE(torch::equal(ya, yb));
      auto gy = torch::arange(yb.numel(), torch::kDouble).view(yb.sizes()).t().contiguous().t();  // non-contiguous grad
      ya.backward(gy);
      yb.backward(gy.contiguous());
      EXPECT_TRUE(torch::equal(a.grad(), b.grad()));
      EXPECT_TRUE(torch::equal(a.detach(), base));  // input untouched
    }
  });
}

TEST_P(TpMappings, IndivisibleSizesAndBadInputsAreClearErrors) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    auto odd = torch::ones({2 * n + 1, 2 * n + 1});
    if (n > 1) {
      EXPECT_THAT(error_of([&] { tp::scatter_to_tp_region(odd, g); }),
                  HasSubstr(c10::str("scatter_to_tp_region rank ", g.rank(), "/", n,
                                     " group 'world' (gloo): dim 1 of "
                                     "float32[",
                                     2 * n + 1, ", ", 2 * n + 1, "] has size ", 2 * n + 1,
                                     ", which is not divisible by the tensor-parallel size ", n)));
      EXPECT_THAT(error_of([&] { tp::scatter_to_sequence_parallel_region(odd, g); }), HasSubstr("dim 0 of float32"));
      EXPECT_THAT(error_of([&] { tp::reduce_scatter_to_sequence_parallel_region(odd, g); }),
                  HasSubstr("reduce_scatter_to_sequence_parallel_region"));
    }
    EXPECT_THAT(error_of([&] { tp::gather_from_tp_region(torch::tensor(1.0), g); }),
                HasSubstr("gather_from_tp_region rank"));
    EXPECT_THAT(error_of([&] { tp::gather_from_tp_region(torch::tensor(1.0), g); }),
                HasSubstr("at least one dimension"));
    EXPECT_THAT(error_of([&] { tp::copy_to_tp_region(at::Tensor(), g); }), HasSubstr("undefined tensor"));
    // The group still works after the rejected calls (nothing reached the transport).
    EXPECT_TRUE(torch::equal(tp::reduce_from_tp_region(torch::ones({2}), g), torch::full({2}, float(n))));
  });
}

INSTANTIATE_TEST_SUITE_P(TpSizes, TpMappings, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return c10::str("tp", info.param); });

}  // namespace
}  // namespace commgrad::testing
