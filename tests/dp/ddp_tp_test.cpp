// Tensor x data parallelism: TP = 2 x DP = 2 on 4 ranks. Each tensor-parallel
// pair holds one replica of a tp::ParallelMLP (Megatron FFN: column- then
// row-parallel linear) and trains on its data-parallel shard of every batch;
// DistributedDataParallel averages the shards' gradients over the DP group.
// After K optimizer steps the gathered full parameters equal K steps of the
// unsplit model (plain torch::nn::Linear layers) on the full batches.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing {
namespace {

constexpr int64_t kHidden = 6;
constexpr int64_t kFfn = 8;
constexpr uint64_t kSeed = 42;

template <typename Module>
std::unique_ptr<torch::optim::Optimizer> make_optimizer(bool adam, Module& module) {
  if (adam) return std::make_unique<torch::optim::Adam>(module->parameters(), torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(module->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
}

TEST(DdpTensorParallel, TwoByTwoMatchesTheUnsplitModel) {
  const int steps = 3;
  const auto x = seeded_randn({steps, 8, kHidden}, 1, torch::kDouble);
  const auto y = seeded_randn({steps, 8, kHidden}, 2, torch::kDouble);
  for (bool adam : {false, true}) {
    SCOPED_TRACE(adam ? "Adam" : "SGD with momentum");
    ReferenceMLP reference(kHidden, kFfn, true, kSeed);
    reference->to(torch::kDouble);
    auto reference_opt = make_optimizer(adam, reference);
    for (int k = 0; k < steps; ++k) {
      reference_opt->zero_grad();
      torch::mse_loss(reference->forward(x[k]), y[k]).backward();
      reference_opt->step();
    }
    spawn_ranks(4, [&](Group& world) {
      auto state = commgrad::make_model_parallel(/*tensor_parallel_size=*/2, 1, world);
      ASSERT_EQ(state.data_parallel_size(), 2);
      tp::ParallelMLP mlp(tp::ParallelMLPOptions(kHidden, kFfn, state.tensor_parallel_group()).seed(kSeed));
      mlp->to(torch::kDouble);
      DistributedDataParallel ddp(mlp, DistributedDataParallelOptions(state.data_parallel_group())
                                           .bucket_cap_mb(0.0002)
                                           .first_bucket_cap_mb(0.0001));
      EXPECT_GT(ddp.buckets().size(), 1u);
      auto opt = make_optimizer(adam, mlp);
      const int dp = state.data_parallel_rank();
      for (int k = 0; k < steps; ++k) {
        opt->zero_grad();
        torch::mse_loss(mlp->forward(x[k].chunk(2, 0)[dp]), y[k].chunk(2, 0)[dp]).backward();
        opt->step();
      }
      const auto full = tp::gather_full_state_dict(*mlp);
      for (const auto& p : reference->named_parameters()) {
        ASSERT_TRUE(full.contains(p.key())) << p.key();
        EXPECT_TRUE(torch::allclose(full[p.key()], p.value(), 1e-9, 1e-11))
            << p.key() << ": max difference " << (full[p.key()] - p.value()).abs().max().item<double>();
      }
    });
  }
}

}  // namespace
}  // namespace commgrad::testing
