// Dense and expert gradients reduced over their own groups (expert_data_parallel.h)
// at EP = 2 x DP = 2 (4 ranks: expert groups [0, 1] [2, 3], expert-data
// groups [0, 2] [1, 3]) against the one-rank model on the whole batch.
//
// Each rank's loss is the mean over its own 7 tokens (what a trainer
// computes); the reference's is the mean over all 28. After the two DDP
// wrappers (or the two ZeroOptimizers) every gradient, dense and expert,
// equals the reference's, and the global norm counts each expert once. The
// last test shows the factor the bugs have: experts averaged over
// the expert-data group alone come out exactly ep = 2 times too large.
// fully_shard (the experts a unit over the expert-data group, the rest one
// over the data group) passes the same bar.

#include "commgrad/dist/parallel_state.h"
#include "commgrad/dp/distributed_data_parallel.h"
#include "commgrad/fsdp/fully_shard.h"
#include "commgrad/moe/expert_data_parallel.h"
#include "commgrad/moe/moe_layer.h"
#include "commgrad/optim/clip_grad.h"
#include "commgrad/optim/zero_optimizer.h"

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <string>

namespace commgrad::moe::expert_data_parallel_test {  // its own namespace: the target compiles as one unity file
namespace {

using commgrad::testing::spawn_ranks;

constexpr int64_t kTokens = 7, kHidden = 8, kRanks = 4;

// A dense projection, then the MoE block with its residual.
struct NetImpl : torch::nn::Module {
  NetImpl(const Group& ep, const Group& batch) {
    proj = register_module("proj", torch::nn::Linear(kHidden, kHidden));
    moe = register_module("moe", MoELayer(MoELayerOptions(kHidden, 16, 4, 2, ep)
                                              .routing(RoutingOptions().aux_loss_coeff(1e-2).batch_group(batch))
                                              .seed(9)));
    torch::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
    proj->weight.copy_(at::randn(proj->weight.sizes(), gen) * 0.3);
    proj->bias.copy_(at::randn(proj->bias.sizes(), gen) * 0.1);
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto h = fsdp::call(proj, x);  // proj(x) unless it is a unit of fully_shard
    return h + moe(h);
  }
  torch::nn::Linear proj{nullptr};
  MoELayer moe{nullptr};
};
TORCH_MODULE(Net);

at::Tensor randn(at::IntArrayRef sizes, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen, at::TensorOptions().dtype(at::kDouble));
}

struct Batch {
  at::Tensor x = randn({kTokens * kRanks, kHidden}, 1);
  at::Tensor g = randn({kTokens * kRanks, kHidden}, 2);
};

// The one-rank model's gradients of the mean over the whole batch.
Net reference_gradients(const Batch& b) {
  Net ref(self_group(), self_group());
  ((ref(b.x) * b.g).sum() / static_cast<double>(b.x.size(0))).backward();
  return ref;
}

// This rank's loss: the mean over its own tokens.
void local_backward(Net& net, const Batch& b, int rank) {
  const auto x = b.x.narrow(0, rank * kTokens, kTokens);
  ((net(x) * b.g.narrow(0, rank * kTokens, kTokens)).sum() / static_cast<double>(kTokens)).backward();
}

void expect_close(const at::Tensor& got, const at::Tensor& expected, const std::string& what) {
  const double err = (got - expected).abs().max().item<double>();
  EXPECT_LE(err, 1e-12 * expected.abs().max().item<double>()) << what << ": max abs error " << err;
}

ParallelState layout(Group& world, int tp = 1) {
  return make_model_parallel(ModelParallelOptions(tp, 1).expert_parallel_size(2), world);
}

// DDP over both groups at TP = tp x DP = 4 / ... x EP = 2: the TP ranks of a
// data rank hold the same tokens and replicate the whole model (nothing is
// split over TP here): no gradient may carry a factor of tp either.
void expect_ddp_equals_one_rank(int tp) {
  const Batch b;
  const Net ref = reference_gradients(b);
  double ref_norm_sq = 0;
  for (const auto& p : ref->parameters()) ref_norm_sq += p.grad().pow(2).sum().item<double>();
  spawn_ranks(kRanks * tp, [&](Group& world) {
    const ParallelState s = layout(world, tp);
    ASSERT_EQ(s.data_context_parallel_group().size(), kRanks);
    Net net(s.expert_parallel_group(), s.data_context_parallel_group());
    EXPECT_EQ(expert_parameter_names(*net).size(), 8U);  // 2 local experts x fc1, fc2 x weight, bias
    dp::DistributedDataParallel dense(net, dense_ddp_options(*net, s.data_context_parallel_group()));
    dp::DistributedDataParallel experts(
        net, expert_ddp_options(*net, s.data_context_parallel_group(), s.expert_data_parallel_group()));
    local_backward(net, b, s.data_context_parallel_group().rank());
    const auto ref_params = ref->named_parameters();
    for (const auto& p : net->named_parameters()) {
      expect_close(p.value().grad(), ref_params[p.key()].grad(), "gradient of " + p.key());
    }
    const double norm = clip_grad_norm_(*net, 0.0, s.expert_parallel_group());
    EXPECT_NEAR(norm, std::sqrt(ref_norm_sq), 1e-12 * norm);
  });
}

TEST(ExpertDataParallelTest, DdpGradientsAndNormEqualOneRankAtEp2Dp2) { expect_ddp_equals_one_rank(1); }
TEST(ExpertDataParallelTest, DdpGradientsAndNormEqualOneRankAtTp2Ep2Dp2) { expect_ddp_equals_one_rank(2); }

TEST(ExpertDataParallelTest, ZeroStepEqualsOneRankSgdAtEp2Dp2) {
  const Batch b;
  const Net ref = reference_gradients(b);
  constexpr double kLr = 0.5;
  spawn_ranks(kRanks, [&](Group& world) {
    const ParallelState s = layout(world);
    Net net(s.expert_parallel_group(), s.data_context_parallel_group());
    auto sgd = [](std::vector<at::Tensor> shards) {
      return std::make_unique<torch::optim::SGD>(shards, torch::optim::SGDOptions(kLr));
    };
    optim::ZeroOptimizer dense(
        net, sgd, optim::ZeroOptimizerOptions(dense_ddp_options(*net, s.data_context_parallel_group())).stage(2));
    optim::ZeroOptimizer experts(net, sgd,
                                 optim::ZeroOptimizerOptions(expert_ddp_options(*net, s.data_context_parallel_group(),
                                                                                s.expert_data_parallel_group()))
                                     .stage(2));
    local_backward(net, b, s.data_context_parallel_group().rank());
    dense.step();
    experts.step();
    const auto ref_params = ref->named_parameters();
    for (const auto& p : net->named_parameters()) {
      const auto& r = ref_params[p.key()];
      expect_close(p.value(), r - kLr * r.grad(), "stepped " + p.key());
    }
  });
}

// The dense optimizer clips both by one global norm (clip_partner): the
// norm and the clipped step equal the one-rank model's.
TEST(ExpertDataParallelTest, ZeroClipsDenseAndExpertsByOneGlobalNormAtEp2Dp2) {
  const Batch b;
  const Net ref = reference_gradients(b);
  double ref_norm_sq = 0;
  for (const auto& p : ref->parameters()) ref_norm_sq += p.grad().pow(2).sum().item<double>();
  const double ref_norm = std::sqrt(ref_norm_sq), max_norm = 0.5 * ref_norm;
  const double coef = optim::clip_coefficient(ref_norm, max_norm);
  ASSERT_LT(coef, 0.6);
  constexpr double kLr = 0.5;
  spawn_ranks(kRanks, [&](Group& world) {
    const ParallelState s = layout(world);
    Net net(s.expert_parallel_group(), s.data_context_parallel_group());
    auto sgd = [](std::vector<at::Tensor> shards) {
      return std::make_unique<torch::optim::SGD>(shards, torch::optim::SGDOptions(kLr));
    };
    optim::ZeroOptimizer experts(net, sgd,
                                 optim::ZeroOptimizerOptions(expert_ddp_options(*net, s.data_context_parallel_group(),
                                                                                s.expert_data_parallel_group()))
                                     .stage(2));
    optim::ZeroOptimizer dense(net, sgd,
                               optim::ZeroOptimizerOptions(dense_ddp_options(*net, s.data_context_parallel_group()))
                                   .stage(2)
                                   .max_grad_norm(max_norm)
                                   .clip_partner(&experts)
                                   .clip_partner_group(s.expert_parallel_group()));
    local_backward(net, b, s.data_context_parallel_group().rank());
    const double norm = dense.step();
    experts.step();
    EXPECT_NEAR(norm, ref_norm, 1e-12 * ref_norm);
    const auto ref_params = ref->named_parameters();
    for (const auto& p : net->named_parameters()) {
      const auto& r = ref_params[p.key()];
      // float32 clip factor (torch::nn::utils::clip_grad_norm_'s rounding).
      expect_close(p.value(), r - kLr * coef * r.grad(), "clipped step of " + p.key());
    }
  });
}

// fully_shard: the experts a unit over the expert-data group (summed,
// divided by the data size), the model a unit over the data group; clipped
// at half the one-rank norm, one SGD step: the norm and every whole
// parameter (dense, router, each expert) equal the one-rank model's. At
// TP = tp the TP ranks replicate the model: no factor of tp either.
void expect_fully_shard_equals_one_rank(int tp) {
  const Batch b;
  const Net ref = reference_gradients(b);
  double ref_norm_sq = 0;
  for (const auto& p : ref->parameters()) ref_norm_sq += p.grad().pow(2).sum().item<double>();
  const double ref_norm = std::sqrt(ref_norm_sq), max_norm = 0.5 * ref_norm;
  const double coef = optim::clip_coefficient(ref_norm, max_norm);
  constexpr double kLr = 0.5;
  spawn_ranks(kRanks * tp, [&](Group& world) {
    const ParallelState s = layout(world, tp);
    const Group& data = s.data_context_parallel_group();
    Net net(s.expert_parallel_group(), data);
    const auto experts = fully_shard_experts(*net, fsdp::FullyShardOptions(data), s.expert_data_parallel_group());
    ASSERT_EQ(experts.size(), 1U);
    EXPECT_EQ(experts[0].group().size(), 2);
    EXPECT_EQ(experts[0].options().average_divisor(), kRanks);
    auto sharded = fsdp::fully_shard(net, data);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(kLr));
    const int rank = data.rank();
    ((fsdp::call(net, b.x.narrow(0, rank * kTokens, kTokens)) * b.g.narrow(0, rank * kTokens, kTokens)).sum() /
     static_cast<double>(kTokens))
        .backward();
    const double norm = sharded.clip_grad_norm_(max_norm);
    EXPECT_NEAR(norm, ref_norm, 1e-12 * ref_norm);
    sgd.step();
    const auto full = sharded.full_state_dict();
    EXPECT_EQ(full.size(), ref->named_parameters().size() - 8);  // the other rank's two experts are not here
    const auto ref_params = ref->named_parameters();
    for (const auto& p : full) {
      const auto& r = ref_params[p.key()];
      expect_close(p.value(), r - kLr * coef * r.grad(), "clipped step of " + p.key());
    }
  });
}

TEST(ExpertDataParallelTest, FullyShardClipsAndStepsLikeOneRankAtEp2Dp2) { expect_fully_shard_equals_one_rank(1); }
TEST(ExpertDataParallelTest, FullyShardClipsAndStepsLikeOneRankAtTp2Ep2Dp4) { expect_fully_shard_equals_one_rank(2); }

TEST(ExpertDataParallelTest, FullyShardExpertsErrors) {
  spawn_ranks(2, [&](Group& world) {
    Net net(world, world);
    EXPECT_THROW_WITH(fully_shard_experts(*net, fsdp::FullyShardOptions(self_group()), world),
                      "moe::fully_shard_experts", "the expert-data group must divide the data group (size 1)");
    EXPECT_THROW_WITH(fully_shard_experts(*net, fsdp::FullyShardOptions(world).replicate_group(world), self_group()),
                      "moe::fully_shard_experts", "replicate_group (HSDP)");
    EXPECT_THROW_WITH(fsdp::fully_shard(net->proj, fsdp::FullyShardOptions(world).average_divisor(-2)), "fully_shard",
                      "average_divisor must be 0", "got -2");
    // A unit over a group that does not divide the outermost unit's cannot be counted once.
    fsdp::fully_shard(net->proj, world);
    auto sharded = fsdp::fully_shard(net, self_group());
    fsdp::call(net, randn({3, kHidden}, 5)).sum().backward();
    EXPECT_THROW_WITH(sharded.clip_grad_norm_(1.0), "fully_shard clip_grad_norm_", "unit of 'proj'",
                      "does not divide the outermost unit's group (size 1)");
  });
}

TEST(ExpertDataParallelTest, AveragingExpertsOverTheExpertDataGroupAloneIsEpTimesTooLarge) {
  const Batch b;
  const Net ref = reference_gradients(b);
  spawn_ranks(kRanks, [&](Group& world) {
    const ParallelState s = layout(world);
    Net net(s.expert_parallel_group(), s.data_context_parallel_group());
    dp::DistributedDataParallel dense(net, dense_ddp_options(*net, s.data_context_parallel_group()));
    auto wrong = expert_ddp_options(*net, s.data_context_parallel_group(), s.expert_data_parallel_group());
    dp::DistributedDataParallel experts(net, wrong.average_divisor(0));  // the group size: edp = 2
    local_backward(net, b, world.rank());
    const auto ref_params = ref->named_parameters();
    for (const auto& name : expert_parameter_names(*net)) {
      expect_close(net->named_parameters()[name].grad(), 2.0 * ref_params[name].grad(), "twice " + name);
    }
  });
}

}  // namespace
}  // namespace commgrad::moe::expert_data_parallel_test
