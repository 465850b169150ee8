// Wrong wiring is an error at construction, on every rank, saying what to
// pass (issue #24's silent mistakes), at TP = 2 x DP = 2 on 4 thread ranks:
// - a data-parallel wrapper (DistributedDataParallel, ZeroOptimizer,
//   fully_shard) given the world, which holds both ranks of each
//   tensor-parallel group, for a module of tensor-parallel shards;
// - a norm's tensor-parallel group that is not the group the shards are
//   split over.
// And the norm over a module (optim::clip_grad_norm_(module, ...)), which
// knows the shards, with DDP follows one rank where the list of parameters
// cannot.
// Before these checks each of them trained silently wrong. Under
// COMMGRAD_DEBUG, DDP also checks at each backward that the TP-replicated
// parameters are still equal across their TP group.

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

namespace commgrad::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kModel = 4, kFfn = 8;

std::unique_ptr<torch::optim::Optimizer> sgd(std::vector<at::Tensor> shards) {
  return std::make_unique<torch::optim::SGD>(shards, torch::optim::SGDOptions(0.1));
}

// What every rank of the world must read when a wrapper takes the world.
std::string world_holds_tp_peers(const Group& world) {
  const int tp0 = world.rank() / 2 * 2;
  return c10::str("the data-parallel group 'world' (ranks [0, 1, 2, 3]) holds ranks ", tp0, " and ", tp0 + 1,
                  " of tensor-parallel group '");
}

TEST(WiringChecks, DataParallelWrappersRejectAGroupHoldingTensorParallelPeers) {
  spawn_ranks(4, [](Group& world) {
    const auto state = make_model_parallel(2, 1, world);
    tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(1));
    const auto want = world_holds_tp_peers(world);
    EXPECT_THAT(
        error_of([&] { dp::DistributedDataParallel(mlp.ptr(), dp::DistributedDataParallelOptions(world)); }),
        AllOf(HasSubstr("DistributedDataParallel rank " + std::to_string(world.rank()) + "/4 group 'world'"),
              HasSubstr(want), HasSubstr("over which parameter 'fc1.weight' is split"),
              HasSubstr("Pass the data-parallel group of the layout to DistributedDataParallelOptions(group)")));
    EXPECT_THAT(error_of([&] { optim::ZeroOptimizer(mlp.ptr(), sgd, optim::ZeroOptimizerOptions(world)); }),
                AllOf(HasSubstr("ZeroOptimizer"), HasSubstr(want), HasSubstr("ZeroOptimizerOptions(group)")));
    EXPECT_THAT(error_of([&] { fsdp::fully_shard(mlp.ptr(), fsdp::FullyShardOptions(world)); }),
                AllOf(HasSubstr("fully_shard"), HasSubstr(want), HasSubstr("FullyShardOptions(group)")));
    // A layout installed but the world passed explicitly: still an error.
    ScopedParallelState scope(state);
    EXPECT_THAT(error_of([&] { dp::DistributedDataParallel(mlp.ptr(), dp::DistributedDataParallelOptions(world)); }),
                HasSubstr(want));
    // The right groups (given, or from the layout) pass the check; the
    // wrappers then run their collectives on the DP groups.
    dp::DistributedDataParallel ddp(mlp.ptr());
    EXPECT_EQ(ddp.group(), state.data_parallel_group());
  });
}

TEST(WiringChecks, ANormGroupOtherThanTheShardsIsAnError) {
  spawn_ranks(4, [](Group& world) {
    const auto state = make_model_parallel(2, 1, world);
    tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(1));
    EXPECT_THAT(error_of([&] {
                  optim::ZeroOptimizer(mlp.ptr(), sgd,
                                       optim::ZeroOptimizerOptions(state.data_parallel_group())
                                           .max_grad_norm(1.0)
                                           .tensor_parallel_group(state.data_parallel_group()));
                }),
                AllOf(HasSubstr("ZeroOptimizer"), HasSubstr("the tensor-parallel group for the norm, '"),
                      HasSubstr("is not the group the module's partitioned parameters are split over")));
  });
}

// Without a TP group, fully_shard's clip_grad_norm_ takes the module's: the
// norm equals the one with the TP group given (it used to be this TP rank's
// shards alone).
TEST(WiringChecks, FullyShardNormTakesTheShardsGroup) {
  spawn_ranks(4, [](Group& world) {
    const auto state = make_model_parallel(2, 1, world);
    double norms[2];
    for (int given = 0; given < 2; ++given) {
      tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(1));
      auto sharded = fsdp::fully_shard(mlp.ptr(), fsdp::FullyShardOptions(state.data_parallel_group()));
      const auto x = torch::ones({2, kModel}).mul(state.data_parallel_rank() + 1);
      fsdp::call(mlp, x).pow(2).sum().backward();
      norms[given] = sharded.clip_grad_norm_(1e9, given ? state.tensor_parallel_group() : Group());
    }
    EXPECT_DOUBLE_EQ(norms[0], norms[1]);
  });
}

// DDP at TP=2 x DP=2 with the module's norm, groups from the layout, against
// plain LibTorch on one rank with the same clipping: step by step.
TEST(WiringChecks, ClipOverAModuleFollowsOneRankWithDdp) {
  constexpr int kSteps = 4;
  const auto x = seeded_randn({kSteps, 8, kModel}, 1), y = seeded_randn({kSteps, 8, kModel}, 2);
  spawn_ranks(4, [&](Group& world) {
    ScopedParallelState scope(make_model_parallel(2, 1, world));
    tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn).seed(42));
    dp::DistributedDataParallel ddp(mlp.ptr());
    torch::optim::AdamW opt(mlp->parameters(), torch::optim::AdamWOptions(0.02));
    ReferenceMLP reference(kModel, kFfn, true, 42);
    torch::optim::AdamW reference_opt(reference->parameters(), torch::optim::AdamWOptions(0.02));
    const int dp = data_parallel_rank();
    const auto result = check::check_trajectory(
        [&](int k) {
          opt.zero_grad();
          auto loss = torch::mse_loss(mlp->forward(x[k].chunk(2, 0)[dp]), y[k].chunk(2, 0)[dp]);
          loss.backward();
          optim::clip_grad_norm_(*mlp, 0.05);
          opt.step();
          return loss.item<double>();
        },
        *mlp,
        [&](int k) {
          reference_opt.zero_grad();
          auto loss = torch::mse_loss(reference->forward(x[k]), y[k]);
          loss.backward();
          optim::clip_grad_norm_(reference->parameters(), 0.05);
          reference_opt.step();
          return loss.item<double>();
        },
        *reference, check::TrajectoryOptions(kSteps));
    EXPECT_TRUE(result.ok()) << result;
  });
}

// A replicated bias that drifted on one rank of each TP group (as after a
// step clipped without the TP group) is a MismatchError at the next
// backward under the debug check, on every rank, naming the parameter and
// the two ranks; equal replicas pass, and so does the backward after the
// bias is mended. Off, the check costs nothing and finds nothing.
TEST(WiringChecks, DebugCheckFindsReplicatedParametersThatDrifted) {
  ops::set_debug_checks(true);
  spawn_ranks(4, [](Group& world) {
    const auto state = make_model_parallel(2, 1, world);
    ScopedParallelState scope(state);
    tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(1));
    dp::DistributedDataParallel ddp(mlp.ptr());
    const auto x = torch::ones({3, kModel});
    EXPECT_EQ(error_of([&] { mlp(x).sum().backward(); }), "(no error)");
    const at::Tensor bias = mlp->fc2->bias;
    const at::Tensor kept = bias.detach().clone();
    if (state.tensor_parallel_group().rank() == 1) bias.detach().add_(1e-6);
    const int tp0 = world.rank() / 2 * 2;
    bool mismatch = false;
    try {
      mlp(x).sum().backward();
    } catch (const MismatchError& e) {
      mismatch = true;
      EXPECT_THAT(e.what_without_backtrace(),
                  AllOf(HasSubstr("DistributedDataParallel rank"),
                        HasSubstr(c10::str("the replicated parameter 'fc2.bias' differs between tensor-parallel ranks ",
                                           tp0, " and ", tp0 + 1))));
    }
    EXPECT_TRUE(mismatch);
    bias.detach().copy_(kept);
    EXPECT_EQ(error_of([&] { mlp(x).sum().backward(); }), "(no error)");
  });
  ops::set_debug_checks(std::nullopt);
  spawn_ranks(2, [](Group& world) {
    const auto state = make_model_parallel(2, 1, world);
    tp::ParallelMLP mlp(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(1));
    dp::DistributedDataParallel ddp(mlp.ptr(), dp::DistributedDataParallelOptions(state.data_parallel_group()));
    if (world.rank() == 1) mlp->fc2->bias.detach().add_(1e-6);
    EXPECT_EQ(error_of([&] { mlp(torch::ones({3, kModel})).sum().backward(); }), "(no error)");
    // The explicit check runs without the debug switch.
    EXPECT_THAT(error_of([&] { tp::check_replicated_parameters(*mlp, "check"); }),
                HasSubstr("the replicated parameter 'fc2.bias' differs between tensor-parallel ranks 0 and 1"));
  });
}

}  // namespace
}  // namespace commgrad::testing
