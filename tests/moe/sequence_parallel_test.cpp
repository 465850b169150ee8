// Experts under sequence parallelism (MoELayerOptions::sequence_parallel_group)
// at TP = 2 with EP = 1 and 2, against the same layer on one rank.
//
// The batch is [s = 6, b, h = 8] sequences: data-parallel replica d holds
// b = 2 of them, and TP rank t of the replica holds rows [3t, 3t + 3) of each
// (Megatron's sequence parallelism). Each TP rank routes and dispatches its
// own rows; the experts are the same on both TP ranks. The one-rank layer sees
// every sequence whole and its loss is the mean over all tokens plus the
// per-sequence balancing loss and the z-loss.
//
// Rank (t, d)'s loss is its part of replica d's mean, (1/(s b)) sum over its
// rows <y, g>: the gradient of its rows is then the replica's, as a vocabulary-
// parallel output layer gives it under SP. The dense wrapper averages over
// data-parallel, the expert wrapper sums over the expert-data group and divides
// by the data-parallel size. Then, with no factor of tp anywhere:
//   - outputs equal the reference's rows, input gradients dp times its rows'
//     (the reference divides by dp more tokens; no reducer touches inputs);
//   - the router's and every expert's gradient equal the reference's, on both
//     TP ranks (the layer summed them over TP in backward);
//   - the balancing and z-losses summed over TP and averaged over data-parallel
//     equal the reference's; the global norm equals its norm.
// float64 within 1e-12 of the largest magnitude.

#include "commgrad/dist/parallel_state.h"
#include "commgrad/dp/distributed_data_parallel.h"
#include "commgrad/moe/expert_data_parallel.h"
#include "commgrad/moe/moe_layer.h"
#include "commgrad/ops/raw.h"

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <sstream>
#include <string>

namespace commgrad::moe::sequence_parallel_test {  // its own namespace: the target compiles as one unity file
namespace {

using commgrad::testing::spawn_ranks;

constexpr int64_t kSeq = 6, kBatch = 2, kHidden = 8, kExperts = 4, kTp = 2;

void expect_close(const at::Tensor& got, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  const double err = (got - expected).abs().max().item<double>();
  EXPECT_LE(err, 1e-12 * expected.abs().max().item<double>()) << what << ": max abs error " << err;
}

at::Tensor randn(at::IntArrayRef sizes, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen, at::TensorOptions().dtype(at::kDouble));
}

MoELayer make_layer(const Group& ep, const Group& sp) {
  MoELayer layer(MoELayerOptions(kHidden, 16, kExperts, 2, ep)
                     .routing(RoutingOptions().aux_loss_coeff(1e-1).z_loss_coeff(1e-2).aux_loss_per_sequence(true))
                     .sequence_parallel_group(sp)
                     .seed(23));
  layer->to(at::kDouble);
  return layer;
}

// Rows [3t, 3t + 3) of replica d's sequences (of `parts` = 2 parts).
at::Tensor shard(const at::Tensor& all, int d, int t, int64_t parts = kTp) {
  return all.narrow(1, d * kBatch, kBatch).narrow(0, t * (kSeq / parts), kSeq / parts).contiguous();
}

// A rank's part of a loss summed over TP, then averaged over data-parallel.
double sum_then_mean(const at::Tensor& part, const Group& tp, const Group& data) {
  auto v = part.detach().reshape({1}).to(at::kDouble);
  if (tp.size() > 1) v = ops::raw::all_reduce(v, {}, tp).wait();
  if (data.size() > 1) v = ops::raw::all_reduce(v, ops::AllReduceOptions().op(ReduceOp::kAvg), data).wait();
  return v.item<double>();
}

void expect_sequence_parallel_equals_one_rank(int dp, int ep) {
  const at::Tensor x_all = randn({kSeq, kBatch * dp, kHidden}, 1), g_all = randn({kSeq, kBatch * dp, kHidden}, 2);
  MoELayer ref = make_layer(self_group(), Group());
  const at::Tensor x_ref = x_all.clone().requires_grad_(true);
  const at::Tensor y_ref = x_ref + ref(x_ref);
  ((y_ref * g_all).sum() / static_cast<double>(x_all.numel() / kHidden)).backward();
  const at::Tensor aux_ref = ref->last_routing().aux_loss, z_ref = ref->last_routing().z_loss;
  double ref_norm_sq = 0;
  for (const auto& p : ref->parameters()) ref_norm_sq += p.grad().pow(2).sum().item<double>();

  spawn_ranks(kTp * dp, [&](Group& world) {
    const ParallelState s = make_model_parallel(ModelParallelOptions(kTp, 1).expert_parallel_size(ep), world);
    const Group& data = s.data_context_parallel_group();
    const Group& tp = s.tensor_parallel_group();
    MoELayer layer = make_layer(s.expert_parallel_group(), tp);
    dp::DistributedDataParallel dense(layer, dense_ddp_options(*layer, data));
    dp::DistributedDataParallel experts(layer, expert_ddp_options(*layer, data, s.expert_data_parallel_group()));
    const int d = data.rank(), t = tp.rank();
    const at::Tensor x = shard(x_all, d, t).requires_grad_(true);
    const at::Tensor y = x + layer(x);
    ((y * shard(g_all, d, t)).sum() / static_cast<double>(kSeq * kBatch)).backward();

    expect_close(y.detach(), shard(y_ref.detach(), d, t), "output");
    expect_close(x.grad(), dp * shard(x_ref.grad(), d, t), "input gradient");
    const auto ref_params = ref->named_parameters();
    for (const auto& p : layer->named_parameters()) {
      expect_close(p.value().grad(), ref_params[p.key()].grad(), "gradient of " + p.key());
    }
    const auto& r = layer->last_routing();
    EXPECT_NEAR(sum_then_mean(r.aux_loss, tp, data), aux_ref.item<double>(), 1e-12 * aux_ref.item<double>());
    EXPECT_NEAR(sum_then_mean(r.z_loss, tp, data), z_ref.item<double>(), 1e-12 * z_ref.item<double>());
    const double norm = clip_grad_norm_(*layer, 0.0, s.expert_parallel_group());
    EXPECT_NEAR(norm, std::sqrt(ref_norm_sq), 1e-12 * norm);
  });
}

TEST(MoESequenceParallelTest, EqualsOneRankAtTp2) { expect_sequence_parallel_equals_one_rank(1, 1); }
TEST(MoESequenceParallelTest, EqualsOneRankAtTp2Ep2) { expect_sequence_parallel_equals_one_rank(2, 2); }
TEST(MoESequenceParallelTest, EqualsOneRankAtTp2Ep2Dp4) { expect_sequence_parallel_equals_one_rank(4, 2); }

// Context parallelism (RoutingOptions::context_parallel_group): the 2 CP
// ranks of a replica hold rows [0, 3) and [3, 6) of its sequences and their
// losses are AVERAGED (Family 1), each the mean over its own tokens. The
// experts are split over EP ranks cut from data x context; the reducers
// average over data x context (experts: summed over the expert-data group,
// divided by dp * cp). The per-sequence counts are summed over CP, P stays
// each rank's mean: the losses averaged over data x context, every gradient
// and the norm equal the one-rank layer's; input gradients are dp * cp times
// its rows'.
// `from_layout`: the layout installed and the router given no CP group.
void expect_context_parallel_equals_one_rank(int dp, int ep, bool from_layout = false) {
  constexpr int kCp = 2;
  const at::Tensor x_all = randn({kSeq, kBatch * dp, kHidden}, 1), g_all = randn({kSeq, kBatch * dp, kHidden}, 2);
  MoELayer ref = make_layer(self_group(), Group());
  const at::Tensor x_ref = x_all.clone().requires_grad_(true);
  const at::Tensor y_ref = x_ref + ref(x_ref);
  ((y_ref * g_all).sum() / static_cast<double>(x_all.numel() / kHidden)).backward();
  double ref_norm_sq = 0;
  for (const auto& p : ref->parameters()) ref_norm_sq += p.grad().pow(2).sum().item<double>();

  spawn_ranks(kCp * dp, [&](Group& world) {
    const ParallelState s =
        make_model_parallel(ModelParallelOptions(1, 1).context_parallel_size(kCp).expert_parallel_size(ep), world);
    const Group& data = s.data_context_parallel_group();
    const Group& cp = s.context_parallel_group();
    std::optional<ScopedParallelState> installed;
    if (from_layout) installed.emplace(s);
    MoELayer layer(MoELayerOptions(kHidden, 16, kExperts, 2, s.expert_parallel_group())
                       .routing(RoutingOptions()
                                    .aux_loss_coeff(1e-1)
                                    .z_loss_coeff(1e-2)
                                    .aux_loss_per_sequence(true)
                                    .context_parallel_group(from_layout ? Group() : cp))
                       .seed(23));
    EXPECT_EQ(layer->router->options.routing().context_parallel_group(), cp);
    layer->to(at::kDouble);
    dp::DistributedDataParallel dense(layer, dense_ddp_options(*layer, data));
    dp::DistributedDataParallel experts(layer, expert_ddp_options(*layer, data, s.expert_data_parallel_group()));
    const int d = s.data_parallel_group().rank(), c = cp.rank();
    const at::Tensor x = shard(x_all, d, c, kCp).requires_grad_(true);
    const at::Tensor y = x + layer(x);
    ((y * shard(g_all, d, c, kCp)).sum() / static_cast<double>(x.numel() / kHidden)).backward();

    expect_close(y.detach(), shard(y_ref.detach(), d, c, kCp), "output");
    expect_close(x.grad(), dp * kCp * shard(x_ref.grad(), d, c, kCp), "input gradient");
    const auto ref_params = ref->named_parameters();
    for (const auto& p : layer->named_parameters()) {
      expect_close(p.value().grad(), ref_params[p.key()].grad(), "gradient of " + p.key());
    }
    const auto& r = layer->last_routing();
    const double aux = ref->last_routing().aux_loss.item<double>(), z = ref->last_routing().z_loss.item<double>();
    EXPECT_NEAR(sum_then_mean(r.aux_loss, self_group(), data), aux, 1e-12 * aux);
    EXPECT_NEAR(sum_then_mean(r.z_loss, self_group(), data), z, 1e-12 * z);
    const double norm = clip_grad_norm_(*layer, 0.0, s.expert_parallel_group());
    EXPECT_NEAR(norm, std::sqrt(ref_norm_sq), 1e-12 * norm);
  });
}

TEST(MoESequenceParallelTest, ContextParallelEqualsOneRankAtCp2Ep2) { expect_context_parallel_equals_one_rank(1, 2); }
TEST(MoESequenceParallelTest, ContextParallelEqualsOneRankAtCp2Ep2Dp2) {
  expect_context_parallel_equals_one_rank(2, 2);
}

// The router takes the context-parallel group from the installed layout
// when given none (its per-sequence loss counted each CP part alone).
TEST(MoESequenceParallelTest, ContextParallelGroupComesFromTheInstalledLayout) {
  expect_context_parallel_equals_one_rank(1, 2, /*from_layout=*/true);
}

// Without the layer's sum over TP (the group not given, the same SP input)
// the gradients are each TP rank's part: the experts' parts sum to the
// reference's; the router's do not even sum to it (its per-sequence
// balancing loss saw half-sequences).
TEST(MoESequenceParallelTest, WithoutTheGroupGradientsArePartialOverTp) {
  const at::Tensor x_all = randn({kSeq, kBatch, kHidden}, 1), g_all = randn({kSeq, kBatch, kHidden}, 2);
  MoELayer ref = make_layer(self_group(), Group());
  ((ref(x_all) * g_all).sum() / static_cast<double>(kSeq * kBatch)).backward();
  spawn_ranks(kTp, [&](Group& world) {
    MoELayer layer = make_layer(self_group(), Group());
    const int t = world.rank();
    ((layer(shard(x_all, 0, t)) * shard(g_all, 0, t)).sum() / static_cast<double>(kSeq * kBatch)).backward();
    const auto ref_params = ref->named_parameters();
    const at::Tensor router = layer->router->weight.grad(), router_ref = ref_params["router.weight"].grad();
    EXPECT_GT((router - router_ref).abs().max().item<double>(), 1e-3 * router_ref.abs().max().item<double>());
    EXPECT_GT((ops::raw::all_reduce(router, {}, world).wait() - router_ref).abs().max().item<double>(),
              1e-6 * router_ref.abs().max().item<double>());
    for (const auto& name : expert_parameter_names(*layer)) {
      expect_close(ops::raw::all_reduce(layer->named_parameters()[name].grad(), {}, world).wait(),
                   ref_params[name].grad(), "summed " + name);
    }
  });
}

TEST(MoESequenceParallelTest, AGroupWithoutThisRankIsAnError) {
  spawn_ranks(3, [](Group& world) {
    auto pair = new_group({0, 2}, NewGroupOptions().name("pair"));
    if (world.rank() == 1) {
      testing::expect_error([&] { make_layer(self_group(), pair); },
                            {"moe::MoELayer", "group 'pair'", "this rank is not a member of the group"});
    }
  });
}

TEST(MoESequenceParallelTest, PrettyPrintNamesTheGroup) {
  spawn_ranks(kTp, [](Group& world) {
    std::ostringstream out;
    make_layer(self_group(), world)->pretty_print(out);
    EXPECT_EQ(out.str(), "commgrad::moe::MoELayer(hidden=8, ffn=16, experts=4, top_k=2, ep=1, sp=2)");
  });
}

}  // namespace
}  // namespace commgrad::moe::sequence_parallel_test
