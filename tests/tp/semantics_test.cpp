// Why tensor parallelism needs Family 2 (docs/design.md, "Gradient semantics").
//
// A row-parallel layer ends in "g" = reduce_from_tp_region: forward
// all-reduce, backward IDENTITY. Every TP rank then computes the same loss L
// from the same replicated output, and each rank's gradient dL/dy is already
// the full gradient of the one objective L. The founding example's AllReduce
// (Family 1, commgrad::ops::all_reduce) has an all-reduce backward too: it
// assumes each rank has its own loss and the objective is sum_r L_r = n L,
// so it sums n identical copies of dL/dy and every gradient upstream of it
// (weights, inputs, everything before the layer) comes out exactly n times
// too large, while forward values and the loss are unchanged - a bug no
// forward test can see. This test keeps anyone from "simplifying" g back into
// an all-reduce.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/check.h>
#include <commgrad/ops.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

// RowParallelLinear's path (scatter the input features, local matmul,
// reduce over the group, add the bias) with the reduction as a parameter.
struct RowPathImpl : torch::nn::Cloneable<RowPathImpl>, tp::ShardedModule {
  RowPathImpl(Group group, int64_t in, int64_t out, bool family_one)
      : group_(std::move(group)), in_(in), out_(out), family_one_(family_one) {
    reset();
  }
  void reset() override {
    const auto full = tp::init_linear(in_, out_, true, 17);
    const auto spec = tp::ShardSpec::partitioned(1);
    weight = register_parameter("weight", tp::shard_tensor(full.weight, spec, group_.rank(), group_.size()));
    bias = register_parameter("bias", full.bias.clone());
    set_shard_spec("weight", spec, group_);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto partial = torch::matmul(tp::scatter_to_tp_region(x, group_), weight.t());
    auto y = family_one_ ? ops::all_reduce(partial, {}, group_)         // the founding example's AllReduce
                         : tp::reduce_from_tp_region(partial, group_);  // "g"
    return y + bias;
  }
  Group group_;
  int64_t in_, out_;
  bool family_one_;
  torch::Tensor weight, bias;
};
TORCH_MODULE(RowPath);

class TpSemantics : public ::testing::TestWithParam<int> {};

TEST_P(TpSemantics, FamilyOneAllReduceMakesUpstreamGradientsTpSizeTimesTooLarge) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    // Upstream of the layer: a replicated scale, so "every gradient upstream"
    // includes one that lives before the layer.
    auto run = [&](bool family_one) {
      RowPath layer(g, 6 * n, 5, family_one);
      auto scale = torch::full({1}, 1.5, torch::requires_grad());
      auto x = seeded_randn({4, 6 * n}, 3).requires_grad_(true);
      auto y = layer(x * scale);
      (y * seeded_randn({4, 5}, 4)).sum().backward();
      return std::make_tuple(y.detach(), x.grad(), scale.grad(), layer->weight.grad(), layer->bias.grad());
    };
    auto ref_layer = reference_linear(6 * n, 5, true, 17);
    auto ref_scale = torch::full({1}, 1.5, torch::requires_grad());
    auto ref_x = seeded_randn({4, 6 * n}, 3).requires_grad_(true);
    auto ref_y = ref_layer(ref_x * ref_scale);
    (ref_y * seeded_randn({4, 5}, 4)).sum().backward();
    const auto ref_w = tp::shard_tensor(ref_layer->weight.grad(), tp::ShardSpec::partitioned(1), g.rank(), n);

    auto [y2, x2, s2, w2, b2] = run(/*family_one=*/false);
    EXPECT_TRUE(torch::allclose(y2, ref_y.detach(), 1e-5, 1e-6));
    EXPECT_TRUE(torch::allclose(x2, ref_x.grad(), 1e-5, 1e-6));
    EXPECT_TRUE(torch::allclose(s2, ref_scale.grad(), 1e-5, 1e-6));
    EXPECT_TRUE(torch::allclose(w2, ref_w, 1e-5, 1e-6));
    EXPECT_TRUE(torch::allclose(b2, ref_layer->bias.grad(), 1e-5, 1e-6));

    auto [y1, x1, s1, w1, b1] = run(/*family_one=*/true);
    EXPECT_TRUE(torch::allclose(y1, ref_y.detach(), 1e-5, 1e-6));          // forward is the same...
    EXPECT_TRUE(torch::allclose(x1, n * ref_x.grad(), 1e-5, 1e-6));        // ...every gradient upstream
    EXPECT_TRUE(torch::allclose(s1, n * ref_scale.grad(), 1e-5, 1e-6));    //    of the all-reduce is
    EXPECT_TRUE(torch::allclose(w1, n * ref_w, 1e-5, 1e-6));               //    n times too large
    EXPECT_TRUE(torch::allclose(b1, ref_layer->bias.grad(), 1e-5, 1e-6));  // (the bias sits after it)
  });
}

TEST_P(TpSemantics, TheCheckerCatchesIt) {
  const int n = GetParam();
  spawn_ranks(n, [n](Group& g) {
    auto x = seeded_randn({4, 6 * n}, 5);
    auto ref = reference_linear(6 * n, 5, true, 17);
    auto real = check::check_gradients(check::subject(RowPath(g, 6 * n, 5, false)), check::subject(ref), {x}, g);
    EXPECT_TRUE(real.ok()) << real;
    auto wrong = check::check_gradients(check::subject(RowPath(g, 6 * n, 5, true)), check::subject(ref), {x}, g);
    if (n == 1) {
      EXPECT_TRUE(wrong.ok()) << wrong;  // one rank cannot tell the families apart
    } else {
      EXPECT_EQ(wrong.failures(), (std::vector<std::string>{"input.grad", "weight.grad"})) << wrong;
      EXPECT_NEAR(wrong.report("weight.grad").max_rel_error, n - 1, 1e-4);  // |n g - g| / |g|
    }
  });
}

INSTANTIATE_TEST_SUITE_P(TpSizes, TpSemantics, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return c10::str("tp", info.param); });

}  // namespace
}  // namespace commgrad::testing
