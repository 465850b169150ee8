// Pipeline x tensor parallelism: TP = 2 x PP = 2 (4 ranks, threads), each
// stage a tp::ParallelMLP (with and without sequence parallelism), every
// schedule, against the unsplit stages on one rank over the whole batch:
// the loss and every parameter's gradient, gathered over the TP group
// (float32, rtol 1e-5, atol 4e-5, as PyTorch's pipelining tests use).
// Plus the zero-bubble schedule with its backward split in every stage, at
// PP = 2-4 and with data parallelism (DDP and ZeRO-2): its gradients are
// 1F1B's, bit for bit.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing {
namespace {

constexpr int64_t kHidden = 6, kFfn = 10, kRows = 16;

struct TpCase {
  std::string schedule;
  int microbatches;
  int stages_per_rank;
  bool sequence_parallel;
};

// The unsplit stages (stage s from seed 10 s + 1) on one rank over the
// whole batch: their loss, after its backward.
at::Tensor unsplit(int stages, const at::Tensor& x, const at::Tensor& y, std::vector<ReferenceMLP>& whole) {
  for (int s = 0; s < stages; ++s) whole.emplace_back(kHidden, kFfn, true, 10 * s + 1);
  auto h = x;
  for (auto& mlp : whole) h = mlp->forward(h);
  const auto loss = torch::mse_loss(h, y);
  loss.backward();
  return loss;
}

class PipelineTimesTensorParallel : public ::testing::TestWithParam<TpCase> {};

TEST_P(PipelineTimesTensorParallel, LossAndEveryGradientMatchOneRank) {
  const auto c = GetParam();
  const int stages = 2 * c.stages_per_rank;
  const auto x = seeded_randn({kRows, kHidden}, 1);
  const auto y = seeded_randn({kRows, kHidden}, 2);
  std::vector<ReferenceMLP> whole;
  const auto ref_loss = unsplit(stages, x, y, whole);

  spawn_ranks(
      4,
      [&](Group& world) {
        auto state = commgrad::make_model_parallel(2, 2, world);
        const auto tp_group = state.tensor_parallel_group();
        const int rank = state.pipeline_parallel_rank();
        std::vector<tp::ParallelMLP> mine;
        std::vector<pp::StageFunction> fns;
        for (int v = 0; v < c.stages_per_rank; ++v) {
          const int s = v * 2 + rank;
          mine.emplace_back(
              tp::ParallelMLPOptions(kHidden, kFfn, tp_group).sequence_parallel(c.sequence_parallel).seed(10 * s + 1));
          fns.push_back(
              [mlp = mine.back(), s, stages, sp = c.sequence_parallel, tp_group](const at::Tensor& in) mutable {
                // Under SP the activations between stages are this TP rank's rows;
                // the loss sees them all (gathered; backward keeps this rank's
                // part of the gradient, which every TP rank computed whole).
                auto a = sp && s == 0 ? tp::scatter_to_sequence_parallel_region(in, tp_group) : in;
                a = mlp(a);
                return sp && s == stages - 1 ? tp::detail::gather_along(a, 0, tp_group, "pipeline_tp_test") : a;
              });
        }
        pp::Pipeline pipe(
            fns, [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); },
            pp::PipelineOptions(c.microbatches)
                .schedule(c.schedule)
                .stages_per_rank(c.stages_per_rank)
                .group(state.pipeline_parallel_group()));
        const auto result = pipe.step(x, y);
        EXPECT_NEAR(result.loss, ref_loss.item<double>(), 1e-5 * ref_loss.item<double>());
        for (int v = 0; v < c.stages_per_rank; ++v) {
          const int s = v * 2 + rank;
          if (c.sequence_parallel) tp::allreduce_sequence_parallel_grads(*mine[v]);
          const auto specs = tp::shard_specs(*mine[v]);
          for (const auto& p : mine[v]->named_parameters()) {
            ASSERT_TRUE(p.value().grad().defined()) << "stage " << s << " " << p.key();
            const auto full = tp::gather_shards(p.value().grad(), specs[p.key()].spec, tp_group);
            const auto want = whole[s]->named_parameters()[p.key()].grad();
            EXPECT_TRUE(torch::allclose(full, want, 1e-5, 4e-5))
                << "stage " << s << " " << p.key() << ": max difference " << (full - want).abs().max().item<double>();
          }
        }
      },
      SpawnOptions().backend("shm"));
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineTimesTensorParallel,
                         ::testing::Values(TpCase{"1f1b", 2, 1, false}, TpCase{"gpipe", 4, 1, false},
                                           TpCase{"1f1b", 4, 1, true}, TpCase{"interleaved", 4, 2, false},
                                           TpCase{"interleaved", 2, 2, true}, TpCase{"zbh1", 2, 1, false},
                                           TpCase{"zbh1", 4, 1, true}),
                         [](const auto& info) {
                           const auto& c = info.param;
                           return c.schedule + "_m" + std::to_string(c.microbatches) +
                                  (c.sequence_parallel ? "_sp" : "");
                         });

// Zero bubble with real B/W splits: ParallelMLP stages (TP = 1) at PP = 2,
// 3, 4 with m = p and an odd m > p, against the unsplit stages, and equal to
// 1F1B bit for bit.
class ZeroBubbleSplitsEveryStage : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(ZeroBubbleSplitsEveryStage, LossAndEveryGradientMatchOneRank) {
  const auto [p, m] = GetParam();
  const auto x = seeded_randn({2 * m, kHidden}, 1);
  const auto y = seeded_randn({2 * m, kHidden}, 2);
  std::vector<ReferenceMLP> whole;
  const auto ref_loss = unsplit(p, x, y, whole);
  spawn_ranks(
      p,
      [&](Group& group) {
        const int s = group.rank();
        std::map<std::string, std::vector<at::Tensor>> grads;
        for (const std::string schedule : {"1f1b", "zbh1"}) {
          tp::ParallelMLP mlp(tp::ParallelMLPOptions(kHidden, kFfn, commgrad::self_group()).seed(10 * s + 1));
          pp::Pipeline pipe(
              {[mlp](const at::Tensor& in) mutable { return mlp(in); }},
              [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); },
              pp::PipelineOptions(m).schedule(schedule).group(group));
          const auto result = pipe.step(x, y);
          EXPECT_NEAR(result.loss, ref_loss.item<double>(), 1e-5 * ref_loss.item<double>());
          for (const auto& param : mlp->named_parameters()) {
            const auto want = whole[s]->named_parameters()[param.key()].grad();
            ASSERT_TRUE(param.value().grad().defined()) << schedule << " stage " << s << " " << param.key();
            EXPECT_TRUE(torch::allclose(param.value().grad(), want, 1e-5, 4e-5))
                << schedule << " stage " << s << " " << param.key();
            grads[schedule].push_back(param.value().grad());
          }
        }
        for (size_t i = 0; i < grads["1f1b"].size(); ++i) {
          EXPECT_TRUE(torch::equal(grads["zbh1"][i], grads["1f1b"][i])) << "stage " << s << " parameter " << i;
        }
      },
      SpawnOptions().backend("shm"));
}

INSTANTIATE_TEST_SUITE_P(Sizes, ZeroBubbleSplitsEveryStage,
                         ::testing::Values(std::pair{2, 2}, std::pair{2, 3}, std::pair{3, 3}, std::pair{3, 5},
                                           std::pair{4, 4}, std::pair{4, 5}),
                         [](const auto& info) { return c10::str("p", info.param.first, "_m", info.param.second); });

// TP = 1 x PP = 2 x DP = 2 ParallelMLP stages, one step under `schedule`:
// every parameter's gradient after the DP reduction (with ZeRO-2, the
// parameters after one SGD step instead, since its gradients live in the
// optimizer's buckets).
std::vector<at::Tensor> data_parallel_step(const std::string& schedule, bool zero, Group& world) {
  const int m = 5;
  auto state = commgrad::make_model_parallel(1, 2, world);
  const int stage = state.pipeline_parallel_rank();
  const int dp = state.data_parallel_rank();
  tp::ParallelMLP mlp(tp::ParallelMLPOptions(kHidden, kFfn, state.tensor_parallel_group()).seed(10 * stage + 1));
  const auto x = seeded_randn({4 * m, kHidden}, 1).chunk(2, 0)[dp];
  const auto y = seeded_randn({4 * m, kHidden}, 2).chunk(2, 0)[dp];
  const auto loss = [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); };
  const auto options = pp::PipelineOptions(m).schedule(schedule).group(state.pipeline_parallel_group());
  const auto stage_fn = [mlp](const at::Tensor& in) mutable { return mlp(in); };
  std::vector<at::Tensor> out;
  if (zero) {
    optim::ZeroOptimizer opt(
        mlp,
        [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1)); },
        optim::ZeroOptimizerOptions(dp::DistributedDataParallelOptions(state.data_parallel_group())).stage(2));
    pp::Pipeline pipe({stage_fn}, loss, pp::PipelineOptions(options).no_sync({pp::no_sync_of(opt)}));
    pipe.step(x, y);
    opt.step();
    for (const auto& p : mlp->parameters()) out.push_back(p.detach().clone());
  } else {
    dp::DistributedDataParallel ddp(mlp, state.data_parallel_group());
    pp::Pipeline pipe({stage_fn}, loss, pp::PipelineOptions(options).no_sync({pp::no_sync_of(ddp)}));
    const auto before = state.data_parallel_group().state()->sequence.load();
    pipe.step(x, y);
    EXPECT_EQ(static_cast<int64_t>(state.data_parallel_group().state()->sequence.load() - before),
              static_cast<int64_t>(ddp.buckets().size()))
        << schedule << ": one reduction per bucket per step";
    for (const auto& p : mlp->parameters()) out.push_back(p.grad().clone());
  }
  return out;
}

TEST(PipelineZeroBubble, DataParallelGradientsAreOneFOneBsBitForBit) {
  for (bool zero : {false, true}) {
    SCOPED_TRACE(zero ? "ZeRO-2" : "DDP");
    spawn_ranks(
        4,
        [&](Group& world) {
          const auto want = data_parallel_step("1f1b", zero, world);
          const auto got = data_parallel_step("zbh1", zero, world);
          ASSERT_EQ(got.size(), want.size());
          for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_TRUE(torch::equal(got[i], want[i]))
                << "parameter " << i << ": max difference " << (got[i] - want[i]).abs().max().item<double>();
          }
        },
        SpawnOptions().backend("shm"));
  }
}

}  // namespace
}  // namespace commgrad::testing
