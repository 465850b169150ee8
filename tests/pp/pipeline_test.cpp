// Pipeline on 2-4 ranks (threads, spawn_ranks): every schedule, with m = p
// microbatches and with an odd m > p, against the whole model on one rank
// over the whole batch: the loss and every parameter's gradient (float64,
// tolerance 1e-10 relative), on shm and Gloo. Plus the errors.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <commgrad/pp/pipeline.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kWidth = 5;

// One stage: Linear + tanh, initialised from its stage index alone.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int stage) {
    fc = register_module("fc", torch::nn::Linear(kWidth, kWidth));
    fc->to(torch::kDouble);
    torch::NoGradGuard no_grad;
    fc->weight.copy_(seeded_randn({kWidth, kWidth}, 100 + stage, torch::kDouble) * 0.5);
    fc->bias.copy_(seeded_randn({kWidth}, 200 + stage, torch::kDouble) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); }

struct Case {
  std::string schedule;
  int ranks;
  int microbatches;
  int stages_per_rank;
  std::string backend;
};
void PrintTo(const Case& c, std::ostream* out) {
  *out << c.schedule << " p=" << c.ranks << " m=" << c.microbatches << " v=" << c.stages_per_rank << " " << c.backend;
}

class PipelineMatchesOneRank : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineMatchesOneRank, LossAndEveryGradient) {
  const auto c = GetParam();
  const int stages = c.ranks * c.stages_per_rank;
  const int64_t batch = 2 * c.microbatches;
  const auto x = seeded_randn({batch, kWidth}, 1, torch::kDouble);
  const auto y = seeded_randn({batch, kWidth}, 2, torch::kDouble);
  // The reference: all stages on one rank, the whole batch.
  std::vector<Block> whole;
  for (int s = 0; s < stages; ++s) whole.emplace_back(s);
  auto h = x;
  for (auto& b : whole) h = b->forward(h);
  auto ref_loss = mse(h, y);
  ref_loss.backward();
  spawn_ranks(
      c.ranks,
      [&](Group& group) {
        std::vector<Block> mine;
        std::vector<pp::StageFunction> fns;
        for (int v = 0; v < c.stages_per_rank; ++v) mine.emplace_back(v * c.ranks + group.rank());
        for (auto& b : mine) fns.push_back([b](const at::Tensor& in) mutable { return b->forward(in); });
        pp::Pipeline pipe(
            fns, mse,
            pp::PipelineOptions(c.microbatches).schedule(c.schedule).stages_per_rank(c.stages_per_rank).group(group));
        for (int repeat = 0; repeat < 2; ++repeat) {  // the second step accumulates
          const auto result = pipe.step(x, y);
          EXPECT_NEAR(result.loss, ref_loss.item<double>(), 1e-12);
          ASSERT_EQ(result.microbatch_losses.size(), static_cast<size_t>(c.microbatches));
          EXPECT_GT(result.compute_seconds, 0.0);
          EXPECT_LE(result.compute_seconds, result.step_seconds);
          for (size_t v = 0; v < mine.size(); ++v) {
            const int stage = v * c.ranks + group.rank();
            for (const auto& p : mine[v]->named_parameters()) {
              const auto want = whole[stage]->named_parameters()[p.key()].grad() * (repeat + 1);
              ASSERT_TRUE(p.value().grad().defined()) << "stage " << stage << " " << p.key();
              EXPECT_TRUE(torch::allclose(p.value().grad(), want, 1e-10, 1e-12))
                  << "stage " << stage << " " << p.key() << ": max difference "
                  << (p.value().grad() - want).abs().max().item<double>();
            }
          }
        }
      },
      SpawnOptions().backend(c.backend));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const std::string backend : {"shm", "gloo"}) {
    for (int p : {2, 3, 4}) {
      for (int m : {p, p + (p % 2 == 0 ? 1 : 2)}) {  // m = p, and an odd m > p
        out.push_back({"gpipe", p, m, 1, backend});
        out.push_back({"1f1b", p, m, 1, backend});
        out.push_back({"zbh1", p, m, 1, backend});  // torch::nn::Linear defers nothing: W does nothing
      }
      out.push_back({"interleaved", p, 2 * p, 2, backend});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineMatchesOneRank, ::testing::ValuesIn(cases()), [](const auto& info) {
  const auto& c = info.param;
  return c.schedule + "_p" + std::to_string(c.ranks) + "_m" + std::to_string(c.microbatches) + "_v" +
         std::to_string(c.stages_per_rank) + "_" + c.backend;
});

TEST(PipelineTest, PipelineTimesDataParallelReducesOncePerStep) {
  // PP = 2 x DP = 2: each stage's DDP reduces after its last microbatch
  // only; the gradients are the whole batch's on one rank. Also under zbh1,
  // whose torch::nn::Linear stages defer nothing: the reduction follows
  // their last B then.
  const int m = 3;
  const auto x = seeded_randn({4 * m, kWidth}, 1, torch::kDouble);
  const auto y = seeded_randn({4 * m, kWidth}, 2, torch::kDouble);
  std::vector<Block> whole{Block(0), Block(1)};
  auto ref_loss = mse(whole[1]->forward(whole[0]->forward(x)), y);
  ref_loss.backward();
  for (const std::string schedule : {"1f1b", "zbh1"})
    spawn_ranks(
        4,
        [&](Group& world) {
          SCOPED_TRACE(schedule);
          auto state = commgrad::make_model_parallel(1, 2, world);
          const int stage = state.pipeline_parallel_rank();
          const int dp = state.data_parallel_rank();
          Block block(stage);
          dp::DistributedDataParallel ddp(block, state.data_parallel_group());
          pp::Pipeline pipe({[block](const at::Tensor& in) mutable { return block->forward(in); }}, mse,
                            pp::PipelineOptions(m)
                                .schedule(schedule)
                                .group(state.pipeline_parallel_group())
                                .no_sync({pp::no_sync_of(ddp)}));
          const auto before = state.data_parallel_group().state()->sequence.load();
          const auto result = pipe.step(x.chunk(2, 0)[dp], y.chunk(2, 0)[dp]);
          EXPECT_EQ(static_cast<int64_t>(state.data_parallel_group().state()->sequence.load() - before),
                    static_cast<int64_t>(ddp.buckets().size()));
          // The DP ranks' mean losses average to the whole batch's.
          auto mean = ops::raw::all_reduce(at::full({1}, result.loss, at::kDouble),
                                           ops::AllReduceOptions().op(ReduceOp::kAvg), state.data_parallel_group())
                          .wait();
          EXPECT_NEAR(mean.item<double>(), ref_loss.item<double>(), 1e-12);
          for (const auto& p : block->named_parameters()) {
            const auto want = whole[stage]->named_parameters()[p.key()].grad();
            EXPECT_TRUE(torch::allclose(p.value().grad(), want, 1e-10, 1e-12)) << "stage " << stage << " " << p.key();
          }
        },
        SpawnOptions().backend("shm"));
}

TEST(PipelineTest, OneDataParallelOverAllOfARanksStagesReducesOncePerStep) {
  // Interleaved, PP = 2 x DP = 2, v = 2: one DDP over both of a rank's
  // stages and one no_sync function; only the rank's last backward reduces.
  const int m = 4, v = 2;
  const auto x = seeded_randn({4 * m, kWidth}, 1, torch::kDouble);
  const auto y = seeded_randn({4 * m, kWidth}, 2, torch::kDouble);
  std::vector<Block> whole;
  for (int s = 0; s < 2 * v; ++s) whole.emplace_back(s);
  auto h = x;
  for (auto& b : whole) h = b->forward(h);
  mse(h, y).backward();
  spawn_ranks(
      4,
      [&](Group& world) {
        auto state = commgrad::make_model_parallel(1, 2, world);
        const int rank = state.pipeline_parallel_rank();
        const int dp = state.data_parallel_rank();
        auto both = std::make_shared<torch::nn::Module>();
        std::vector<Block> mine;
        std::vector<pp::StageFunction> fns;
        for (int i = 0; i < v; ++i) {
          mine.push_back(both->register_module("stage" + std::to_string(i), Block(i * 2 + rank)));
          fns.push_back([b = mine.back()](const at::Tensor& in) mutable { return b->forward(in); });
        }
        dp::DistributedDataParallel ddp(both, state.data_parallel_group());
        pp::Pipeline pipe(fns, mse,
                          pp::PipelineOptions(m)
                              .schedule("interleaved")
                              .stages_per_rank(v)
                              .group(state.pipeline_parallel_group())
                              .no_sync({pp::no_sync_of(ddp)}));
        const auto before = state.data_parallel_group().state()->sequence.load();
        pipe.step(x.chunk(2, 0)[dp], y.chunk(2, 0)[dp]);
        EXPECT_EQ(static_cast<int64_t>(state.data_parallel_group().state()->sequence.load() - before),
                  static_cast<int64_t>(ddp.buckets().size()));
        for (int i = 0; i < v; ++i) {
          for (const auto& p : mine[i]->named_parameters()) {
            const auto want = whole[i * 2 + rank]->named_parameters()[p.key()].grad();
            EXPECT_TRUE(torch::allclose(p.value().grad(), want, 1e-10, 1e-12))
                << "stage " << i * 2 + rank << " " << p.key();
          }
        }
      },
      SpawnOptions().backend("shm"));
}

TEST(PipelineTest, AFailingRankEndsTheOthersWithItsMessage) {
  // Three ranks: the middle one checks no batch, so it learns of rank 0's
  // bad inputs only from rank 0; and a stage of the middle rank throws.
  // Every rank must end with the failing rank's own message (after a
  // timeout it would say something else).
  const auto x = seeded_randn({8, kWidth}, 1, torch::kDouble);
  for (const std::string how : {"bad inputs", "stage throws"}) {
    SCOPED_TRACE(how);
    spawn_ranks(
        3,
        [&](Group& group) {
          Block block(group.rank());
          int calls = 0;
          pp::StageFunction fn = [&, block](const at::Tensor& in) mutable {
            if (how == "stage throws" && group.rank() == 1 && ++calls == 2)
              throw std::runtime_error("stage 1 went wrong");
            return block->forward(in);
          };
          pp::Pipeline pipe({fn}, mse, pp::PipelineOptions(4).group(group));
          const auto inputs = how == "bad inputs" && group.rank() == 0 ? x.slice(0, 0, 6) : x;
          try {
            pipe.step(inputs, x);
            ADD_FAILURE() << "rank " << group.rank() << " finished its step";
          } catch (const c10::Error& e) {
            const std::string what = e.what_without_backtrace();
            if (how == "bad inputs") {
              EXPECT_THAT(what, HasSubstr("a batch of 6 inputs (float64[6, 5]) does not split into 4 microbatches"));
              if (group.rank() == 1) {
                EXPECT_THAT(what, HasSubstr("(recvA1.0): pipeline rank 0 (previous stage 0) failed"));
              }
              if (group.rank() == 2) {
                EXPECT_THAT(what, HasSubstr("(recvA2.0): pipeline rank 1 (previous stage 1) failed"));
              }
            } else {
              EXPECT_THAT(what, HasSubstr("stage 1 microbatch 1 (F1.1) failed: stage 1 went wrong"));
              if (group.rank() == 0) {
                EXPECT_THAT(what, HasSubstr("pipeline rank 1 (next stage 1) failed"));
              }
              if (group.rank() == 2) {
                EXPECT_THAT(what, HasSubstr("(recvA2.1): pipeline rank 1 (previous stage 1) failed"));
              }
            }
          }
        },
        SpawnOptions().backend("shm"));
  }
}

TEST(PipelineTest, BadInputIsAnErrorOnEveryRank) {
  spawn_ranks(2, [&](Group& group) {
    Block block(group.rank());
    pp::StageFunction fn = [block](const at::Tensor& in) mutable { return block->forward(in); };
    const auto x = seeded_randn({6, kWidth}, 1, torch::kDouble);
    try {
      pp::Pipeline pipe({fn}, mse, pp::PipelineOptions(1).group(group));
      ADD_FAILURE() << "1 microbatch for 2 ranks was accepted";
    } catch (const std::exception& e) {
      EXPECT_THAT(e.what(), HasSubstr("1 microbatches for 2 pipeline ranks"));
    }
    EXPECT_THROW(pp::Pipeline({fn, fn}, mse, pp::PipelineOptions(2).group(group)), c10::Error);
    pp::NoSyncFunction hold = [] { return std::shared_ptr<void>(); };
    try {
      pp::Pipeline pipe(
          {fn, fn, fn}, mse,
          pp::PipelineOptions(2).schedule("interleaved").stages_per_rank(3).group(group).no_sync({hold, hold}));
      ADD_FAILURE() << "2 no_sync functions for 3 stages were accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("no_sync has 2 functions for 3 stages on this rank (give one per stage, or one for all"));
    }
    pp::Pipeline pipe({fn}, mse, pp::PipelineOptions(4).group(group));
    // 6 rows do not split into 4 microbatches: rank 0 (inputs) and rank 1 (targets) both say so.
    try {
      pipe.step(x, x);
      ADD_FAILURE() << "a batch of 6 into 4 microbatches was accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("does not split into 4 microbatches of equal size"));
    }
  });
}

}  // namespace
}  // namespace commgrad::testing
