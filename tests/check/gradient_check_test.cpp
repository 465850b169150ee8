// The gradient checker as a user meets it: a hand-written parallel layer
// that declares its shards, the table, replicas that drift apart on one
// rank, custom losses and tolerances.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/check.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

// A user's own parallel layer: y = x * scale with `scale` split along its
// only dim (each rank scales its slice of the features), gathered at the
// end. Deriving from tp::ShardedModule and declaring the split is all the
// checker needs.
struct ShardedScaleImpl : torch::nn::Cloneable<ShardedScaleImpl>, tp::ShardedModule {
  ShardedScaleImpl(Group group, int64_t features) : group_(std::move(group)), features_(features) { reset(); }
  void reset() override {
    auto full = torch::arange(1, features_ + 1, torch::kFloat) / features_;
    scale = register_parameter("scale",
                               tp::shard_tensor(full, tp::ShardSpec::partitioned(0), group_.rank(), group_.size()));
    set_shard_spec("scale", tp::ShardSpec::partitioned(0), group_);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return tp::gather_from_tp_region(tp::scatter_to_tp_region(x, group_) * scale, group_);
  }
  Group group_;
  int64_t features_;
  torch::Tensor scale;
};
TORCH_MODULE(ShardedScale);

struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(int64_t features) {
    scale = register_parameter("scale", torch::arange(1, features + 1, torch::kFloat) / features);
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * scale; }
  torch::Tensor scale;
};
TORCH_MODULE(Scale);

TEST(CheckGradients, AHandWrittenShardedLayer) {
  spawn_ranks(3, [](Group& g) {
    auto r = check::check_gradients(check::subject(ShardedScale(g, 9)), check::subject(Scale(9)),
                                    {seeded_randn({2, 9}, 1)}, check::GradCheckOptions(g).title("scale"));
    EXPECT_TRUE(r.ok()) << r;
    EXPECT_EQ(r.report("scale").layout, "split(0)");
    EXPECT_EQ(r.report("scale.grad").shape, (std::vector<int64_t>{9}));
    EXPECT_THAT(r.table(), HasSubstr("commgrad::check scale tp=3 float32 (pass: max|p-r| <= atol + rtol*max|r|)\n"));
    EXPECT_THAT(r.table(), HasSubstr("all 5 tensors match"));
    std::ostringstream printed;
    printed << r;
    EXPECT_EQ(printed.str(), r.table());
  });
}

TEST(CheckGradients, AReplicaThatDriftsOnOneRankIsCaught) {
  // The reference is right; on rank 1 only, the replicated parameter is off.
  spawn_ranks(2, [](Group& g) {
    Scale parallel(6);
    if (g.rank() == 1) {
      torch::NoGradGuard no_grad;
      parallel->scale[2] += 0.5;
    }
    auto r = check::check_gradients(check::subject(parallel), check::subject(Scale(6)), {seeded_randn({2, 6}, 2)}, g);
    // Every rank reports the maximum over ranks: the same verdict everywhere.
    EXPECT_FALSE(r.ok());
    EXPECT_THAT(r.failures(), ::testing::Contains("scale"));
    EXPECT_NEAR(r.report("scale").max_abs_error, 0.5, 1e-6);
  });
}

TEST(CheckGradients, CustomLossAndTolerances) {
  spawn_ranks(2, [](Group& g) {
    auto par =
        check::subject(tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(3, 4, g).gather_output(true).seed(6)));
    auto ref = check::subject(reference_linear(3, 4, true, 6));
    auto options =
        check::GradCheckOptions(g).loss([](const at::Tensor& y) { return y.pow(2).mean(); }).atol(0.5).rtol(0);
    auto r = check::check_gradients(par, ref, {seeded_randn({5, 3}, 7)}, options);
    EXPECT_TRUE(r.ok()) << r;
    EXPECT_EQ(r.report("output").atol, 0.5);
    EXPECT_EQ(r.report("output").rtol, 0.0);
    // A reference that differs by less than atol passes; by more, fails.
    auto shifted = reference_linear(3, 4, true, 6);
    {
      torch::NoGradGuard no_grad;
      shifted->bias.add_(0.25);
    }
    EXPECT_TRUE(check::check_gradients(par, check::subject(shifted), {seeded_randn({5, 3}, 7)}, options).ok());
    {
      torch::NoGradGuard no_grad;
      shifted->bias.add_(0.5);
    }
    EXPECT_FALSE(check::check_gradients(par, check::subject(shifted), {seeded_randn({5, 3}, 7)}, options).ok());
  });
}

TEST(CheckGradients, DefaultTolerancesFollowTheDtype) {
  spawn_ranks(1, [](Group& g) {
    auto run = [&](torch::ScalarType dtype) {
      Scale a(3), b(3);
      a->to(dtype);
      b->to(dtype);
      return check::check_gradients(check::subject(a), check::subject(b), {seeded_randn({2, 3}, 1, dtype)}, g);
    };
    auto f32 = run(torch::kFloat32);
    EXPECT_EQ(f32.report("output").atol, 1e-5);
    EXPECT_EQ(f32.report("output").rtol, 1e-4);
    auto f64 = run(torch::kFloat64);
    EXPECT_EQ(f64.report("output").atol, 1e-10);
    EXPECT_EQ(f64.report("output").rtol, 1e-8);
    EXPECT_THAT(f64.table(), HasSubstr("tp=1 float64"));
  });
}

}  // namespace
}  // namespace commgrad::testing
