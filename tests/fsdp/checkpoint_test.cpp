// Sharded checkpoints of fully_shard: saved under FSDP at one size, loaded
// under FSDP at another, under ZeroOptimizer (ZeRO-2), and the other way
// round; every continuation follows one rank trained without interruption.

#include "harness/spawn_ranks.h"
#include "harness/temp_dir.h"
#include "tp/reference.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace commgrad::testing::fsdp_checkpoint_test {  // its own namespace: the target compiles as one unity file
namespace {

namespace fsdp = commgrad::fsdp;
using ::testing::HasSubstr;

constexpr int64_t kIn = 7, kHidden = 13, kOut = 5, kBatch = 12;  // 12 splits over 1, 2, 3 and 4 ranks

struct NetImpl : torch::nn::Module {
  explicit NetImpl(uint64_t seed) {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(seeded_randn(p.sizes(), seed++) * 0.3);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fsdp::call(fc2, torch::tanh(fsdp::call(fc1, x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

torch::optim::AdamOptions adam() { return torch::optim::AdamOptions(0.02); }

// This rank's rows of step k's global batch, and its loss (the mean over
// the ranks' losses is the one-rank loss).
torch::Tensor loss_of(const torch::Tensor& y, int k, int rank, int n) {
  const auto target = seeded_randn({kBatch, kOut}, 900 + k).chunk(n, 0)[rank];
  return (y - target).pow(2).mean();
}
torch::Tensor input_of(int k, int rank, int n) { return seeded_randn({kBatch, kIn}, 800 + k).chunk(n, 0)[rank]; }

// One rank, steps [0, steps): the parameters by name.
std::map<std::string, at::Tensor> one_rank(int steps) {
  Net net(1);
  torch::optim::Adam opt(net->parameters(), adam());
  for (int k = 0; k < steps; ++k) {
    loss_of(net->forward(input_of(k, 0, 1)), k, 0, 1).backward();
    opt.step();
    opt.zero_grad();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

struct Fsdp {
  // Seed 77 is another initialisation than the one rank's: a load must overwrite it.
  explicit Fsdp(const Group& g, uint64_t seed = 77) : net(seed) {
    fsdp::fully_shard(net->fc1, g);
    sharded = fsdp::fully_shard(net, g);
    opt = std::make_unique<torch::optim::Adam>(net->parameters(), adam());
  }
  void train(int from, int to, const Group& g) {
    for (int k = from; k < to; ++k) {
      loss_of(fsdp::call(net, input_of(k, g.rank(), g.size())), k, g.rank(), g.size()).backward();
      opt->step();
      opt->zero_grad();
    }
  }
  std::vector<checkpoint::TensorPiece> pieces() {
    auto all = checkpoint::fsdp_pieces(sharded);
    for (auto& p : checkpoint::fsdp_optimizer_pieces(sharded, *opt)) all.push_back(std::move(p));
    return all;
  }
  void load(const std::string& dir, const Group& g) {
    auto model = checkpoint::fsdp_pieces(sharded);
    auto optim = checkpoint::fsdp_optimizer_load_pieces(sharded, *opt);
    auto all = model;
    all.insert(all.end(), optim.begin(), optim.end());
    const auto result = checkpoint::load(dir, all, {}, g);
    checkpoint::restore_fsdp_optimizer(
        sharded, *opt, std::vector<checkpoint::TensorPiece>(all.begin() + model.size(), all.end()), result);
  }
  Net net;
  fsdp::FullyShardedModule sharded;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

struct Zero {
  explicit Zero(const Group& g, uint64_t seed = 77)
      : net(seed),
        zero(
            net, [](auto shards) { return std::make_unique<torch::optim::Adam>(shards, adam()); },
            optim::ZeroOptimizerOptions(dp::DistributedDataParallelOptions(g)).stage(2)) {}
  void train(int from, int to, const Group& g) {
    for (int k = from; k < to; ++k) {
      zero.zero_grad();
      loss_of(net->forward(input_of(k, g.rank(), g.size())), k, g.rank(), g.size()).backward();
      zero.step();
    }
  }
  void load(const std::string& dir, const Group& g) {
    auto model = checkpoint::module_pieces(*net);
    auto optim = checkpoint::optimizer_load_pieces(zero);
    auto all = model;
    all.insert(all.end(), optim.begin(), optim.end());
    const auto result = checkpoint::load(dir, all, {}, g);
    checkpoint::restore_optimizer(zero, std::vector<checkpoint::TensorPiece>(all.begin() + model.size(), all.end()),
                                  result);
  }
  Net net;
  optim::ZeroOptimizer zero;
};

void expect_near(const std::map<std::string, at::Tensor>& want,
                 const torch::OrderedDict<std::string, at::Tensor>& got) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, value] : want) {
    EXPECT_TRUE(torch::allclose(got[name], value, 1e-5, 1e-6))
        << name << ": max difference " << (got[name] - value).abs().max().item<double>();
  }
}

TEST(FullyShardCheckpoint, SavedUnderFsdpLoadsUnderFsdpAtAnotherSizeAndUnderZero) {
  TempRoot root("fsdp_ckpt");
  const auto want = one_rank(6);
  spawn_ranks(2, [&](Group& world) {
    Fsdp f(world, 1);
    f.train(0, 3, world);
    checkpoint::save(root.str(), 3, f.pieces(), {}, {}, world);
  });
  spawn_ranks(3, [&](Group& world) {  // FSDP at 3 ranks
    Fsdp f(world);
    f.load(root.str(), world);
    f.train(3, 6, world);
    expect_near(want, f.sharded.full_state_dict());
  });
  spawn_ranks(4, [&](Group& world) {  // ZeRO-2 at 4 ranks
    Zero z(world);
    z.load(root.str(), world);
    z.train(3, 6, world);
    expect_near(want, z.net->named_parameters());
  });
}

TEST(FullyShardCheckpoint, SavedUnderZeroLoadsUnderFsdp) {
  TempRoot root("zero_ckpt");
  const auto want = one_rank(6);
  spawn_ranks(3, [&](Group& world) {
    Zero z(world, 1);
    z.train(0, 3, world);
    auto pieces = checkpoint::module_pieces(*z.net);
    for (auto& p : checkpoint::optimizer_pieces(z.zero)) pieces.push_back(std::move(p));
    checkpoint::save(root.str(), 3, pieces, {}, {}, world);
  });
  spawn_ranks(2, [&](Group& world) {
    Fsdp f(world);
    f.load(root.str(), world);
    f.train(3, 6, world);
    expect_near(want, f.sharded.full_state_dict());
  });
}

TEST(FullyShardCheckpoint, AWeightsOnlyCheckpointIsAClearErrorForTheOptimizer) {
  TempRoot root("fsdp_weights");
  spawn_ranks(2, [&](Group& world) {
    Fsdp f(world);
    checkpoint::save(root.str(), 1, checkpoint::fsdp_pieces(f.sharded), {}, {}, world);
    EXPECT_THAT([&] { f.load(root.str(), world); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr("holds no optimizer state under 'optim/'")));
  });
}

}  // namespace
}  // namespace commgrad::testing::fsdp_checkpoint_test
