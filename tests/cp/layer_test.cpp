// tp::ParallelSelfAttention with context parallelism against its unsplit
// reference (tp::SelfAttentionReference from the same seed, one rank, the
// whole sequence), float64: the output, the input gradient and every
// parameter gradient (summed over the context-parallel ranks, each holding
// the share of its tokens; gathered over TP) at TP=1 x CP=2 and TP=2 x CP=2
// (+SP), every mode. And the layer's errors under context parallelism.

#include "commgrad/cp/attention.h"
#include "commgrad/cp/sequence.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/dp/distributed_data_parallel.h"
#include "commgrad/fsdp/fully_shard.h"
#include "commgrad/optim/zero_optimizer.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/attention.h"
#include "commgrad/tp/reference.h"
#include "commgrad/tp/sharding.h"

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::cp::layer_test {  // its own namespace: the target compiles as one unity file
namespace {

using commgrad::testing::error_of;

using commgrad::testing::spawn_ranks;
using ::testing::HasSubstr;

constexpr int64_t kHeads = 4, kHidden = 24, kSeq = 16, kBatch = 2;
constexpr auto kLayout = SequenceLayout::kHeadTail;

void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& expected) {
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(got, expected, 1e-10, 1e-10))
      << what << ": max abs err " << (got - expected).abs().max().item<double>();
}

// This rank's part of a [s, b, h] tensor: its CP part, then its SP chunk.
at::Tensor local_part(const at::Tensor& x, const Group& tp, const Group& cp, bool sp) {
  at::Tensor part = shard_sequence(x, 0, kLayout, cp);
  return sp ? part.chunk(tp.size(), 0)[tp.rank()] : part;
}

at::Tensor whole(const at::Tensor& local, const Group& tp, const Group& cp, bool sp) {
  at::Tensor part = sp ? ops::raw::all_gather(local, ops::AllGatherOptions().dim(0), tp).wait() : local;
  return unshard_sequence(part, 0, kLayout, cp);
}

void check_layer(const ParallelState& state, AttentionMode mode, bool sp) {
  SCOPED_TRACE(::testing::Message() << mode_name(mode) << " tp " << state.tensor_parallel_size() << (sp ? " sp" : ""));
  const Group tp = state.tensor_parallel_group(), cp = state.context_parallel_group();
  tp::ParallelSelfAttention layer(tp::ParallelSelfAttentionOptions(kHidden, kHeads, tp)
                                      .seed(5)
                                      .sequence_parallel(sp)
                                      .context_parallel(ContextParallelOptions(cp, mode)));
  tp::SelfAttentionReference reference(tp::ParallelSelfAttentionOptions(kHidden, kHeads, self_group()).seed(5));
  layer->to(at::kDouble);
  reference->to(at::kDouble);
  auto gen = at::detail::createCPUGenerator(77);
  const at::Tensor x = at::randn({kSeq, kBatch, kHidden}, gen, at::kDouble);
  const at::Tensor w = at::randn({kSeq, kBatch, kHidden}, gen, at::kDouble);

  const at::Tensor xl = local_part(x, tp, cp, sp).clone().requires_grad_();
  const at::Tensor out = layer(xl);
  (out * local_part(w, tp, cp, sp)).sum().backward();
  const at::Tensor xr = x.clone().requires_grad_();
  const at::Tensor expected = reference(xr);
  (expected * w).sum().backward();

  at::NoGradGuard no_grad;
  expect_close("output", whole(out, tp, cp, sp), expected);
  expect_close("input gradient", whole(xl.grad(), tp, cp, sp), xr.grad());
  // Parameters: each CP rank holds the share of its tokens (summed over
  // CP), under SP each TP rank the share of its chunk for the partial_grad
  // ones (summed over TP), and TP-split ones are gathered whole.
  const auto reference_params = reference->named_parameters();
  const auto specs = tp::shard_specs(*layer);
  for (const auto& p : layer->named_parameters()) {
    const auto& spec = specs[p.key()].spec;
    at::Tensor g = ops::raw::all_reduce(p.value().grad(), {}, cp).wait();
    if (spec.partial_grad) g = ops::raw::all_reduce(g, {}, tp).wait();
    g = tp::gather_shards(g, spec, tp);
    const at::Tensor& want = reference_params[p.key()].grad();
    expect_close(p.key() + " gradient", g, want);
    // The comparison sees a gradient off by a factor (a wrong divisor).
    EXPECT_FALSE(at::allclose(g * 2, want, 1e-10, 1e-10)) << p.key();
  }
}

TEST(CpSelfAttention, MatchesTheReferenceAtTp1AndTp2) {
  spawn_ranks(4, [](Group& world) {
    const auto tp1 = make_model_parallel(ModelParallelOptions(1).context_parallel_size(2), world);  // CP 2 x DP 2
    const auto tp2 = make_model_parallel(ModelParallelOptions(2).context_parallel_size(2), world);
    for (const auto mode : {AttentionMode::kAllGather, AttentionMode::kRing, AttentionMode::kUlysses}) {
      check_layer(tp1, mode, false);
      check_layer(tp2, mode, false);
      check_layer(tp2, mode, true);
    }
  });
}

// A reducer given the data-parallel group alone under context parallelism
// (each CP rank holds part of every sequence: its gradients are partial)
// would let the CP ranks' parameters drift apart: DDP, ZeroOptimizer and
// fully_shard refuse it at construction, naming the group to pass; the data
// x context group is accepted.
TEST(CpSelfAttention, ReducersOverTheDataGroupAloneAreErrors) {
  spawn_ranks(4, [](Group& world) {
    const auto state = make_model_parallel(ModelParallelOptions(1).context_parallel_size(2), world);  // CP 2 x DP 2
    auto make = [&] {
      return tp::ParallelSelfAttention(tp::ParallelSelfAttentionOptions(kHidden, kHeads, self_group())
                                           .seed(5)
                                           .context_parallel(ContextParallelOptions(state.context_parallel_group())));
    };
    const std::string advice = "Pass ParallelState::data_context_parallel_group() to ";
    auto sgd = [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, 0.1); };
    auto a = make(), b = make(), c = make();
    EXPECT_THAT(error_of([&] { dp::DistributedDataParallel(a, state.data_parallel_group()); }),
                HasSubstr("'' attends across the context-parallel group"));
    EXPECT_THAT(error_of([&] { dp::DistributedDataParallel(a, state.data_parallel_group()); }),
                HasSubstr(advice + "DistributedDataParallelOptions(group)"));
    EXPECT_THAT(
        error_of([&] { optim::ZeroOptimizer(b, sgd, optim::ZeroOptimizerOptions(state.data_parallel_group())); }),
        HasSubstr(advice + "ZeroOptimizerOptions(group)"));
    EXPECT_THAT(error_of([&] { fsdp::fully_shard(c, state.data_parallel_group()); }),
                HasSubstr(advice + "FullyShardOptions(group)"));
    dp::DistributedDataParallel ddp(make(), state.data_context_parallel_group());
    fsdp::fully_shard(make(), state.data_context_parallel_group());
  });
}

TEST(CpSelfAttention, Errors) {
  spawn_ranks(2, [](Group& g) {
    const std::string where = g.describe() + ": ";
    const Group alone = self_group();
    EXPECT_THAT(error_of([&] {
                  tp::ParallelSelfAttention(tp::ParallelSelfAttentionOptions(8, 2, alone)
                                                .attention_dropout(0.1)
                                                .context_parallel(ContextParallelOptions(g)));
                }),
                HasSubstr("attention_dropout (0.1) is not supported under context parallelism (cp=2, ring)"));
    EXPECT_THAT(error_of([&] {
                  tp::ParallelSelfAttention(tp::ParallelSelfAttentionOptions(9, 3, alone)
                                                .context_parallel(ContextParallelOptions(g, AttentionMode::kUlysses)));
                }),
                HasSubstr("context-parallel mode ulysses splits the 3 heads of each tensor-parallel rank (3 heads over "
                          "TP=1) over CP=2, which does not divide them; use allgather or ring"));
    tp::ParallelSelfAttention layer(
        tp::ParallelSelfAttentionOptions(8, 2, alone).context_parallel(ContextParallelOptions(g)));
    EXPECT_THAT(error_of([&] {
                  layer(at::zeros({3, 1, 8}));
                }),
                HasSubstr("[commgrad] cp::attention " + where +
                          "the sequence of 6 tokens (3 on each of 2 ranks) does "
                          "not split into 4 equal chunks for the head-tail layout"));
    std::ostringstream printed;
    layer->pretty_print(printed);
    EXPECT_THAT(printed.str(), HasSubstr(", cp=2 (ring))"));
  });
}

}  // namespace
}  // namespace commgrad::cp::layer_test
