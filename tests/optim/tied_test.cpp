// ZeroOptimizer's tied parameters (a pipeline's shared embedding): the
// first and the last stage each hold a copy of W, each replica reduces its
// copy's gradient over DP (reduce-scatter), then the two copies' ranges are
// summed over the embedding group. After K steps of AdamW with clipping both
// copies equal the W of one model that holds every stage, and the other
// parameters equal theirs (PP = 2 and 3, DP = 2, ZeRO-1 and -2, threads).
// Plus: the tied parameter has a bucket of its own, and the errors.

#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kVocab = 6, kWidth = 5, kOut = 3, kBatch = 8;
constexpr int kSteps = 4;
constexpr double kMaxNorm = 0.05;  // small: clipping is active in every step

// The stages' parameters, with the same values in every thread.
at::Tensor initial_w() { return seeded_randn({kVocab, kWidth}, 1) * 0.5; }
torch::nn::Linear head(int64_t in, uint64_t seed) {
  torch::nn::Linear l(in, kOut);
  torch::NoGradGuard no_grad;
  l->weight.copy_(seeded_randn(l->weight.sizes(), seed) * 0.3);
  l->bias.copy_(seeded_randn(l->bias.sizes(), seed + 1) * 0.3);
  return l;
}

// Stage s's loss on rows x: the first stage uses W as x W^T, the last as x W,
// a middle one does not use it.
at::Tensor stage_loss(int s, int stages, const at::Tensor& w, torch::nn::Linear& lin, const at::Tensor& x,
                      const at::Tensor& y) {
  at::Tensor h;
  if (s == 0)
    h = torch::tanh(x.narrow(1, 0, kWidth).matmul(w.t()));
  else if (s == stages - 1)
    h = torch::tanh(x.narrow(1, 0, kVocab).matmul(w));
  else
    h = torch::tanh(x.narrow(1, 0, 4));
  return torch::mse_loss(lin(h), y);
}
int64_t stage_input(int s, int stages) { return s == 0 ? kVocab : s == stages - 1 ? kWidth : 4; }

struct StageImpl : torch::nn::Module {
  StageImpl(int s, int stages) {
    if (s == 0 || s == stages - 1) w = register_parameter("tied", initial_w());
    lin = register_module("lin", head(stage_input(s, stages), 10 + s));
  }
  at::Tensor w;
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Stage);

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.02).weight_decay(0.1));
}

class ZeroTied : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ZeroTied, BothCopiesFollowTheOneModel) {
  const int stages = std::get<0>(GetParam());
  const int zero_stage = std::get<1>(GetParam());
  const auto x = seeded_randn({kSteps, kBatch, 8}, 2);
  const auto y = seeded_randn({kSteps, kBatch, kOut}, 3);

  // One model holding every stage: one W, the loss summed over the stages.
  auto w = initial_w().requires_grad_();
  std::vector<torch::nn::Linear> heads;
  std::vector<at::Tensor> params{w};
  for (int s = 0; s < stages; ++s) {
    heads.push_back(head(stage_input(s, stages), 10 + s));
    for (const auto& p : heads.back()->parameters()) params.push_back(p);
  }
  auto ref_opt = adamw(params);
  for (int k = 0; k < kSteps; ++k) {
    ref_opt->zero_grad();
    at::Tensor loss = torch::zeros({});
    for (int s = 0; s < stages; ++s) loss = loss + stage_loss(s, stages, w, heads[s], x[k], y[k]);
    loss.backward();
    optim::clip_grad_norm_(params, kMaxNorm);
    ref_opt->step();
  }

  spawn_ranks(2 * stages, [&](Group& world) {
    auto state = commgrad::make_model_parallel(1, stages, world);
    const int s = state.pipeline_parallel_rank();
    const int dp = state.data_parallel_rank();
    Stage stage(s, stages);
    const bool holds_w = s == 0 || s == stages - 1;
    optim::ZeroOptimizer zero(
        stage, adamw,
        optim::ZeroOptimizerOptions(dp::DistributedDataParallelOptions(state.data_parallel_group())
                                        .bucket_cap_mb(0.0001)
                                        .first_bucket_cap_mb(0.0001))
            .stage(zero_stage)
            .max_grad_norm(kMaxNorm)
            .pipeline_parallel_group(state.pipeline_parallel_group())
            .tied_parameters(holds_w ? std::vector<std::string>{"tied"} : std::vector<std::string>{})
            .tied_group(state.embedding_group()));
    for (const auto& b : zero.ddp().buckets()) {
      if (std::find(b.names.begin(), b.names.end(), "tied") != b.names.end()) {
        EXPECT_EQ(b.names.size(), 1u);  // alone, so both copies split alike
      }
    }
    for (int k = 0; k < kSteps; ++k) {
      zero.zero_grad();
      stage_loss(s, stages, stage->w, stage->lin, x[k].chunk(2, 0)[dp], y[k].chunk(2, 0)[dp]).backward();
      EXPECT_GT(zero.step(), kMaxNorm);
    }
    if (holds_w) {
      EXPECT_TRUE(torch::allclose(stage->w, w, 1e-5, 1e-6))
          << "stage " << s << ": max difference " << (stage->w - w).abs().max().item<double>();
    }
    for (const auto& p : stage->lin->named_parameters()) {
      const auto want = heads[s]->named_parameters()[p.key()];  // a handle: the dict is a temporary
      EXPECT_TRUE(torch::allclose(p.value(), want, 1e-5, 1e-6))
          << "stage " << s << " " << p.key() << ": max difference " << (p.value() - want).abs().max().item<double>();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(StagesAndZero, ZeroTied, ::testing::Combine(::testing::Values(2, 3), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return "pp" + std::to_string(std::get<0>(info.param)) + "_zero" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(ZeroTied, CopiesThatDifferAreErrorsOnEveryRank) {
  spawn_ranks(2, [](Group& world) {
    auto state = commgrad::make_model_parallel(1, 2, world);
    const int s = state.pipeline_parallel_rank();
    auto module = std::make_shared<torch::nn::Module>();
    module->register_parameter("tied", s == 0 ? at::zeros({4, 3}) : at::zeros({4, 2}));
    try {
      optim::ZeroOptimizer zero(module, adamw,
                                optim::ZeroOptimizerOptions(state.data_parallel_group())
                                    .tied_parameters({"tied"})
                                    .tied_group(state.embedding_group()));
      ADD_FAILURE() << "copies of different shapes were accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("the tied parameters ('tied', ...) are not split like group rank " + std::to_string(1 - s) +
                            "'s copies: this rank has data-parallel rank 0/1 and [" + (s == 0 ? "12" : "8") +
                            "] elements, rank " + std::to_string(1 - s) + " has 0/1 and [" + (s == 0 ? "8" : "12") +
                            "] elements"));
    }
  });
}

TEST(ZeroTied, BadNamesAndAMissingGroupAreErrors) {
  spawn_ranks(1, [](Group& world) {
    auto module = std::make_shared<torch::nn::Module>();
    module->register_parameter("w", at::zeros({3}));
    try {
      optim::ZeroOptimizer zero(module, adamw, optim::ZeroOptimizerOptions(world).tied_parameters({"v"}));
      ADD_FAILURE() << "an unknown tied parameter was accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("tied parameter 'v' is not a trainable parameter"));
    }
    try {
      optim::ZeroOptimizer zero(module, adamw, optim::ZeroOptimizerOptions(world).tied_parameters({"w"}));
      ADD_FAILURE() << "tied parameters without a tied group were accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("tied_parameters are named ('w', ...) but tied_group is not set"));
    }
  });
}

}  // namespace
}  // namespace commgrad::testing
