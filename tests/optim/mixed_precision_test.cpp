// dp::MixedPrecisionPolicy in DistributedDataParallel and ZeroOptimizer, and
// ZeroOptimizer with a DynamicLossScaler, on 3 ranks (threads over shm):
//   * bfloat16 parameters with float32 reductions equal an explicit
//     emulation (cast each gradient to float32, divide by 3, sum in float32
//     over the group; DDP rounds the sum into .grad(), ZeroOptimizer steps
//     float32 masters with it unrounded and rounds the parameters), bit for
//     bit: shm sums every element in rank order, as the emulation's
//     all-reduce does;
//   * float16 with an inf injected into one rank's range of the reduced
//     gradients: every rank skips that step (parameters bit for bit as
//     before) and the scale backs off; the other steps equal the emulation
//     with the scale applied and removed;
//   * float16 reductions (DDP, ZeroOptimizer, fully_shard at 2, 4 and 8
//     ranks) divide before the sum as FSDP2 does, so a sum that overflows
//     float16 averages right;
//   * the errors (output_dtype, a scaler that does not agree over the
//     data-parallel group) and the deprecated float32_master alias.

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>

namespace commgrad::testing {
namespace {

constexpr int kRanks = 3;
constexpr int64_t kIn = 7;
constexpr int64_t kHidden = 13;
constexpr int64_t kOut = 5;
constexpr int64_t kBatch = 12;  // 4 rows per rank
constexpr int kSteps = 4;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
    torch::NoGradGuard no_grad;
    uint64_t seed = 300;
    for (auto& p : parameters()) p.copy_(seeded_randn(p.sizes(), seed++) * 0.3);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

dp::DistributedDataParallelOptions small_buckets(const Group& group) {
  return dp::DistributedDataParallelOptions(group).bucket_cap_mb(0.0002).first_bucket_cap_mb(0.0001);
}

dp::MixedPrecisionPolicy policy(at::ScalarType compute) {
  return dp::MixedPrecisionPolicy().param_dtype(compute).reduce_dtype(at::kFloat);
}

// This rank's rows of step k, in `dtype`; the target in float32.
std::pair<at::Tensor, at::Tensor> rows(int k, int rank, at::ScalarType dtype) {
  const auto x = seeded_randn({kBatch, kIn}, 500 + k).chunk(kRanks, 0)[rank].to(dtype);
  const auto y = seeded_randn({kBatch, kOut}, 600 + k).chunk(kRanks, 0)[rank];
  return {x, y};
}

// The loss in float32 (1.13 has no 16-bit mse on the CPU), times `scale`.
at::Tensor loss_of(Net& net, int k, int rank, at::ScalarType dtype, double scale = 1) {
  auto [x, y] = rows(k, rank, dtype);
  return (net->forward(x).to(at::kFloat) - y).pow(2).mean() * scale;
}

// The emulated float32 reduction of `net`'s gradients over `world`.
std::vector<at::Tensor> reduced_in_float32(Net& net, const Group& world) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) {
    auto g = p.grad().to(at::kFloat).div_(world.size());
    ops::raw::all_reduce_(g, {}, world).wait();
    out.push_back(g);
  }
  return out;
}

void expect_bitwise(Net& a, Net& b, const std::string& what) {
  const auto pa = a->named_parameters();
  const auto pb = b->named_parameters();
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::equal(item.value(), pb[item.key()]))
        << what << " " << item.key() << ": max difference "
        << (item.value().to(at::kFloat) - pb[item.key()].to(at::kFloat)).abs().max().item<double>();
  }
}

TEST(DdpMixedPrecision, Bfloat16ParametersWithFloat32ReductionEqualTheEmulation) {
  spawn_ranks(
      kRanks,
      [&](Group& world) {
        Net net, ref;
        ref->to(at::kBFloat16);
        dp::DistributedDataParallel ddp(net, small_buckets(world).mixed_precision(policy(at::kBFloat16)));
        for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);  // cast by DDP
        ASSERT_GT(ddp.buckets().size(), 1u);
        for (const auto& b : ddp.buckets()) {
          EXPECT_EQ(b.dtype, at::kFloat);
          EXPECT_EQ(b.param_dtype, at::kBFloat16);
        }
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        for (int k = 0; k < kSteps; ++k) {
          opt.zero_grad();
          ref_opt.zero_grad();
          loss_of(net, k, world.rank(), at::kBFloat16).backward();
          loss_of(ref, k, world.rank(), at::kBFloat16).backward();
          const auto reduced = reduced_in_float32(ref, world);
          const auto params = ref->parameters();
          const auto mine = net->parameters();
          for (size_t i = 0; i < params.size(); ++i) {
            params[i].mutable_grad() = reduced[i].to(at::kBFloat16);  // rounded once, at the end
            EXPECT_EQ(mine[i].grad().scalar_type(), at::kBFloat16);
            EXPECT_TRUE(torch::equal(mine[i].grad(), params[i].grad())) << "step " << k << " parameter " << i;
          }
          opt.step();
          ref_opt.step();
        }
        expect_bitwise(net, ref, "DDP");
      },
      SpawnOptions().backend("shm"));
}

// ZeroOptimizer (stage 1 or 2) with bfloat16 compute, float32 reductions
// and float32 masters against the emulation stepping float32 masters.
class ZeroMixedPrecisionPolicy : public ::testing::TestWithParam<int> {};

TEST_P(ZeroMixedPrecisionPolicy, Bfloat16ComputeWithFloat32ReductionEqualsTheEmulation) {
  const int stage = GetParam();
  spawn_ranks(
      kRanks,
      [&](Group& world) {
        Net net, ref;
        ref->to(at::kBFloat16);
        auto adamw = [](std::vector<at::Tensor> p) {
          return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
        };
        optim::ZeroOptimizer zero(net, adamw,
                                  optim::ZeroOptimizerOptions(small_buckets(world))
                                      .stage(stage)
                                      .max_grad_norm(0.5)
                                      .mixed_precision(policy(at::kBFloat16)));
        for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
        for (const auto& s : zero.shards()) EXPECT_EQ(s.state_dtype, at::kFloat);
        const auto params = ref->parameters();
        std::vector<at::Tensor> masters;
        for (const auto& p : params) masters.push_back(p.detach().to(at::kFloat));
        auto ref_opt = adamw(masters);
        for (int k = 0; k < kSteps; ++k) {
          zero.zero_grad();
          loss_of(net, k, world.rank(), at::kBFloat16).backward();
          zero.step();

          for (auto& p : params) p.mutable_grad() = at::Tensor();
          loss_of(ref, k, world.rank(), at::kBFloat16).backward();
          const auto reduced = reduced_in_float32(ref, world);
          torch::NoGradGuard no_grad;
          for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = reduced[i];  // not rounded
          optim::clip_grad_norm_(masters, 0.5);
          ref_opt->step();
          for (size_t i = 0; i < masters.size(); ++i) params[i].copy_(masters[i]);
        }
        expect_bitwise(net, ref, "ZeRO-" + std::to_string(stage));
        const auto full = zero.full_state_dict();
        const auto names = ref->named_parameters();
        for (size_t i = 0; i < names.size(); ++i) {
          EXPECT_TRUE(torch::equal(full[names[i].key() + "/master"], masters[i])) << names[i].key();
        }
      },
      SpawnOptions().backend("shm"));
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroMixedPrecisionPolicy, ::testing::Values(1, 2),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// The first element of this rank's first non-empty range: (parameter, element).
std::pair<std::string, int64_t> first_owned_element(const optim::ZeroOptimizer& zero) {
  for (const auto& s : zero.shards()) {
    if (!s.segments.empty()) return {s.segments.front().name, s.segments.front().param_begin};
  }
  return {"", -1};
}

TEST(ZeroLossScaler, InfInOneRanksRangeSkipsTheStepEverywhereAndBacksOff) {
#if TORCH_VERSION_MAJOR < 2
  GTEST_SKIP() << "LibTorch 1.13 has no float16 matmul on CPU";
#endif
  const int inf_step = 1;
  spawn_ranks(
      kRanks,
      [&](Group& world) {
        Net net, ref;
        ref->to(at::kHalf);
        auto sgd = [](std::vector<at::Tensor> p) {
          return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9));
        };
        auto scaler_options = optim::DynamicLossScalerOptions().initial_scale(1024).hysteresis(1).groups({world});
        optim::DynamicLossScaler scaler(scaler_options), ref_scaler(scaler_options);
        optim::ZeroOptimizer zero(net, sgd,
                                  optim::ZeroOptimizerOptions(small_buckets(world))
                                      .stage(2)
                                      .mixed_precision(policy(at::kHalf))
                                      .loss_scaler(&scaler));
        // The last rank injects an inf into an element only its range holds.
        const auto [name, element] = first_owned_element(zero);
        const auto params = ref->parameters();
        std::vector<at::Tensor> masters;
        for (const auto& p : params) masters.push_back(p.detach().to(at::kFloat));
        auto ref_opt = sgd(masters);
        for (int k = 0; k < kSteps; ++k) {
          SCOPED_TRACE("step " + std::to_string(k));
          const bool bad = k == inf_step && world.rank() == kRanks - 1;
          std::optional<unsigned> hook;
          at::Tensor target = bad ? net->named_parameters()[name] : at::Tensor();
          if (bad) {
            hook = target.register_hook([e = element](at::Tensor g) {
              g = g.clone();
              g.view({-1})[e] = INFINITY;
              return g;
            });
          }
          std::vector<at::Tensor> before;
          for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
          const double scale = scaler.scale();
          zero.zero_grad();
          scaler.scale(loss_of(net, k, world.rank(), at::kHalf)).backward();
          const double norm = zero.step();
          if (hook) target.remove_hook(*hook);
          EXPECT_EQ(std::isnan(norm), k == inf_step);
          if (k == inf_step) {
            const auto after = net->parameters();
            for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(after[i], before[i])) << i;
          }

          // The emulation: scaled float16 gradients, reduced in float32, unscaled.
          for (auto& p : params) p.mutable_grad() = at::Tensor();
          loss_of(ref, k, world.rank(), at::kHalf, scale).backward();
          auto reduced = reduced_in_float32(ref, world);
          const bool skip = k == inf_step;
          ref_scaler.update(skip);
          if (skip) continue;
          torch::NoGradGuard no_grad;
          for (size_t i = 0; i < masters.size(); ++i) {
            masters[i].mutable_grad() = reduced[i].mul_(static_cast<float>(1.0 / scale));
          }
          ref_opt->step();
          for (size_t i = 0; i < masters.size(); ++i) params[i].copy_(masters[i]);
        }
        EXPECT_EQ(scaler.skipped_steps(), 1);
        EXPECT_EQ(scaler.scale(), 512);  // hysteresis 1: the inf step backed off
        EXPECT_EQ(scaler.scale(), ref_scaler.scale());
        expect_bitwise(net, ref, "float16 ZeRO-2");
      },
      SpawnOptions().backend("shm"));
}

// ~~~ 16-bit reductions: the average split around the sum ~~~

// One float16 parameter whose gradient is the constant the rank's loss
// multiplies it by (computed in float32: no float16 arithmetic on the CPU).
struct WideGradientImpl : torch::nn::Module {
  WideGradientImpl() { w = register_parameter("w", at::zeros({6})); }
  at::Tensor forward(const at::Tensor& c) { return (w.to(at::kFloat) * c).sum(); }
  at::Tensor w;
};
TORCH_MODULE(WideGradient);

// G + 64 r, every one exact in float16 (largest 65504): the plain sum of n
// overflows (n G > 65504), the sum of the pre-divided ones does not
// (n G / f < 65504 for FSDP's factor f: 2 at 2 and 4 ranks, 4 at 8).
double wide_base(int n) { return n == 2 ? 40000.0 : 24000.0; }
at::Tensor wide_gradient(int rank, int n) { return at::full({6}, wide_base(n) + 64.0 * rank); }
double wide_average(int n) { return wide_base(n) + 32.0 * (n - 1); }

enum class Reducer { kDdp, kZero, kFullyShard };

// The averaged gradient `reducer` hands the optimizer, in float32.
at::Tensor reduced_wide_gradient(Reducer reducer, Group& world) {
  const auto half = dp::MixedPrecisionPolicy().param_dtype(at::kHalf).reduce_dtype(at::kHalf);
  WideGradient net;
  if (reducer == Reducer::kDdp) {
    dp::DistributedDataParallel ddp(net, dp::DistributedDataParallelOptions(world).mixed_precision(half));
    net->forward(wide_gradient(world.rank(), world.size())).backward();
    return net->w.grad().to(at::kFloat);
  }
  if (reducer == Reducer::kZero) {
    at::Tensor seen;
    auto sgd = [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, 0.0); };
    optim::ZeroOptimizer zero(net, sgd, optim::ZeroOptimizerOptions(world).stage(2).mixed_precision(half));
    zero.register_gradient_hook([&](const std::vector<optim::ZeroOptimizer::StateShard>& grads) {
      for (const auto& g : grads)
        seen = seen.defined() ? at::cat({seen, g.tensor.to(at::kFloat)}) : g.tensor.to(at::kFloat);
    });
    net->forward(wide_gradient(world.rank(), world.size())).backward();
    zero.step();
    return seen.defined() ? seen : at::empty({0});
  }
  auto sharded = fsdp::fully_shard(net, fsdp::FullyShardOptions(world).mixed_precision(half));
  fsdp::call_function(*net, [&] { return net->forward(wide_gradient(world.rank(), world.size())); }).backward();
  sharded.finish_gradients();
  std::vector<at::Tensor> mine{at::empty({0})};  // this rank's pieces (none for an empty shard)
  for (const auto& piece : checkpoint::fsdp_gradient_pieces(sharded)) mine.push_back(piece.tensor.to(at::kFloat));
  return at::cat(mine);
}

// FSDP2's rule: with a 16-bit reduce_dtype each gradient is divided by a
// power of two f before the sum and by n / f after it, so that a sum of n
// gradients that fit the dtype fits too. Here the plain float16 sum
// overflows (checked first: the values are in the regime that needs the
// split) and every reducer's average is finite and right, at 2, 4 and 8
// ranks, over Gloo and shm.
TEST(SixteenBitReductions, DivideBeforeTheSumSoThatItDoesNotOverflow) {
  for (int n : {2, 4, 8}) {
    for (const char* backend : {"gloo", "shm"}) {
      spawn_ranks(
          n,
          [&](Group& world) {
            const auto plain =
                ops::raw::all_reduce(wide_gradient(world.rank(), world.size()).to(at::kHalf), {}, world).wait();
            EXPECT_TRUE(torch::isinf(plain).all().item<bool>()) << "the plain float16 sum should overflow";
            for (auto reducer : {Reducer::kDdp, Reducer::kZero, Reducer::kFullyShard}) {
              const auto g = reduced_wide_gradient(reducer, world);
              const auto expected = at::full_like(g, wide_average(n));
              EXPECT_TRUE(torch::allclose(g, expected, 2e-3, 0))
                  << "reducer " << static_cast<int>(reducer) << " at " << n << " ranks over " << backend << ": " << g;
            }
          },
          SpawnOptions().backend(backend));
    }
  }
}

TEST(ZeroLossScaler, ErrorsAndTheFloat32MasterAlias) {
  EXPECT_FALSE(optim::ZeroOptimizerOptions().float32_master(false).mixed_precision().float32_master());
  EXPECT_TRUE(optim::ZeroOptimizerOptions().float32_master());
  spawn_ranks(2, [&](Group& world) {
    auto sgd = [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, 0.1); };
    const auto output = dp::MixedPrecisionPolicy().output_dtype(at::kBFloat16);
    Net a, b, c;
    EXPECT_THROW_WITH(dp::DistributedDataParallel(a, small_buckets(world).mixed_precision(output)),
                      "DistributedDataParallel", "rank", "output_dtype", "does not wrap forward");
    EXPECT_THROW_WITH(optim::ZeroOptimizer(b, sgd, optim::ZeroOptimizerOptions(world).mixed_precision(output)),
                      "ZeroOptimizer", "rank", "output_dtype", "does not wrap forward");
    optim::DynamicLossScaler elsewhere(optim::DynamicLossScalerOptions().groups({self_group()}));
    EXPECT_THROW_WITH(optim::ZeroOptimizer(c, sgd, optim::ZeroOptimizerOptions(world).loss_scaler(&elsewhere)),
                      "ZeroOptimizer", "rank", "none of which is the data-parallel group");
  });
}

}  // namespace
}  // namespace commgrad::testing
