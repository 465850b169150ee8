// DistributedDataParallel on 1-4 ranks (threads over Gloo, spawn_ranks):
// K optimizer steps of DDP, each rank on its shard of every batch, end with
// the parameters of K steps of one process on the full batches; plus
// no_sync accumulation, overlap of bucket all-reduces with backward, the
// error cases and the communication hooks. Models run in float64 so that
// the only differences from the reference are rounding (tolerance 1e-9).

#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"

#include <commgrad/commgrad.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;
using torch::Tensor;

// A model with a virtual forward, so that tests can swap models.
struct Net : torch::nn::Module {
  virtual Tensor forward(Tensor x) = 0;
};

struct Mlp : Net {
  explicit Mlp(int64_t hidden = 8) {
    fc1 = register_module("fc1", torch::nn::Linear(4, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 8));
    fc3 = register_module("fc3", torch::nn::Linear(8, 2));
  }
  Tensor forward(Tensor x) override { return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// An MLP with buffers: a fixed input normalisation and a forward counter.
struct BufferedMlp : Mlp {
  BufferedMlp() {
    mean = register_buffer("mean", torch::randn({4}));
    scale = register_buffer("scale", torch::rand({4}) + 0.5);
    calls = register_buffer("calls", torch::zeros({}, torch::kLong));
  }
  Tensor forward(Tensor x) override {
    {
      torch::NoGradGuard no_grad;
      calls += 1;
    }
    return Mlp::forward((x - mean) * scale);
  }
  Tensor mean, scale, calls;
};

// An MLP with a second head that only some forwards use.
struct TwoHeads : Mlp {
  TwoHeads() { head2 = register_module("head2", torch::nn::Linear(8, 2)); }
  Tensor forward(Tensor x) override { return forward_heads(x, false); }
  Tensor forward_heads(const Tensor& x, bool use_head2) {
    auto h = torch::tanh(fc2(torch::tanh(fc1(x))));
    return use_head2 ? fc3(h) + head2(h) : fc3(h);
  }
  torch::nn::Linear head2{nullptr};
};

enum class Model { kMlp, kBuffered };
enum class Optim { kSgd, kAdam };

// Built on the calling (main) thread: the seed is process-wide.
std::shared_ptr<Net> make_net(Model model, uint64_t seed, torch::Dtype dtype = torch::kDouble) {
  torch::manual_seed(seed);
  std::shared_ptr<Net> net;
  if (model == Model::kMlp) {
    net = std::make_shared<Mlp>();
  } else {
    net = std::make_shared<BufferedMlp>();
  }
  net->to(dtype);
  return net;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim optim, const std::vector<Tensor>& params) {
  if (optim == Optim::kSgd) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

// `steps` batches of 12 samples (divisible by 1, 2, 3 and 4 ranks).
struct Data {
  Tensor x, y;
};
Data make_data(int steps, uint64_t seed, torch::Dtype dtype = torch::kDouble) {
  torch::manual_seed(seed);
  return Data{torch::randn({steps, 12, 4}, dtype), torch::randn({steps, 12, 2}, dtype)};
}

Tensor shard(const Tensor& batch, int rank, int n) { return batch.chunk(n, 0)[rank]; }

// Plain training loop: rank `rank` of `n` trains on its shard of each batch.
void train(Net& net, torch::optim::Optimizer& opt, const Data& data, int rank, int n, bool grads_to_none) {
  for (int64_t k = 0; k < data.x.size(0); ++k) {
    if (grads_to_none) {
      net.zero_grad(/*set_to_none=*/true);
    } else {
      opt.zero_grad();
    }
    auto loss = torch::mse_loss(net.forward(shard(data.x[k], rank, n)), shard(data.y[k], rank, n));
    loss.backward();
    opt.step();
  }
}

void expect_same_state(const torch::nn::Module& got, const torch::nn::Module& want, double rtol = 1e-9) {
  auto want_params = want.named_parameters();
  for (const auto& p : got.named_parameters()) {
    const auto& w = want_params[p.key()];
    EXPECT_TRUE(torch::allclose(p.value(), w, rtol, rtol * 1e-2))
        << p.key() << ": max difference " << (p.value() - w).abs().max().item<double>();
  }
  auto want_buffers = want.named_buffers();
  for (const auto& b : got.named_buffers()) {
    EXPECT_TRUE(torch::allclose(b.value(), want_buffers[b.key()], rtol, rtol * 1e-2)) << b.key();
  }
}

// ---------------------------------------------------------------------------
// K steps of DDP == K steps of one process on the full batch.

bool have_backend(const std::string& backend) {
  const auto all = available_backends();
  return std::find(all.begin(), all.end(), backend) != all.end();
}

// (ranks, transport)
class DdpMatchesSingleProcess : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(DdpMatchesSingleProcess, SgdMomentumAndAdamForMlpAndBufferedModel) {
  const int n = std::get<0>(GetParam());
  const auto backend = std::get<1>(GetParam());
  if (!have_backend(backend)) GTEST_SKIP() << "backend " << backend << " is not in this build";
  const auto data = make_data(/*steps=*/4, /*seed=*/7);
  for (auto model : {Model::kMlp, Model::kBuffered}) {
    for (auto optim : {Optim::kSgd, Optim::kAdam}) {
      SCOPED_TRACE(::testing::Message() << "model " << static_cast<int>(model) << " optimizer "
                                        << static_cast<int>(optim));
      // SGD runs with gradients as bucket views and zero_grad(); Adam with
      // copies and gradients set to none between steps.
      const bool views = optim == Optim::kSgd;
      auto reference = make_net(model, 100);
      auto reference_opt = make_optimizer(optim, reference->parameters());
      train(*reference, *reference_opt, data, 0, 1, !views);

      // Each rank starts from different values: DDP must broadcast rank 0's.
      std::vector<std::shared_ptr<Net>> nets;
      for (int r = 0; r < n; ++r) nets.push_back(make_net(model, 100 + r));
      spawn_ranks(
          n,
          [&](Group& group) {
            auto& net = nets[group.rank()];
            DistributedDataParallel ddp(net, DistributedDataParallelOptions(group)
                                                 .bucket_cap_mb(0.0002)
                                                 .first_bucket_cap_mb(0.0001)
                                                 .gradient_as_bucket_view(views));
            EXPECT_GT(ddp.buckets().size(), 2u);
            auto opt = make_optimizer(optim, net->parameters());
            train(*net, *opt, data, group.rank(), group.size(), !views);
            expect_same_state(*net, *reference);
            EXPECT_EQ(ddp.last_step().buckets, static_cast<int64_t>(ddp.buckets().size()));
          },
          SpawnOptions().backend(backend));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, DdpMatchesSingleProcess,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values("gloo", "shm")),
                         [](const auto& info) {
                           return std::get<1>(info.param) + "_" + std::to_string(std::get<0>(info.param));
                         });

TEST(DdpTest, SumReductionGivesNTimesTheAverage) {
  const auto data = make_data(1, 3);
  auto reference = make_net(Model::kMlp, 5);
  torch::mse_loss(reference->forward(data.x[0]), data.y[0]).backward();
  std::vector<std::shared_ptr<Net>> nets;
  for (int r = 0; r < 3; ++r) nets.push_back(make_net(Model::kMlp, 5 + r));
  spawn_ranks(3, [&](Group& group) {
    auto& net = nets[group.rank()];
    DistributedDataParallel ddp(net, DistributedDataParallelOptions(group).reduction(GradReduction::kSum));
    torch::mse_loss(net->forward(shard(data.x[0], group.rank(), 3)), shard(data.y[0], group.rank(), 3)).backward();
    auto want = reference->named_parameters();
    for (const auto& p : net->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value().grad(), want[p.key()].grad() * 3, 1e-9, 1e-12)) << p.key();
    }
  });
}

// ---------------------------------------------------------------------------
// Construction: broadcast and replica check.

TEST(DdpTest, BroadcastsParametersAndBuffersFromTheFirstRank) {
  std::vector<std::shared_ptr<Net>> nets;
  for (int r = 0; r < 3; ++r) nets.push_back(make_net(Model::kBuffered, 40 + r));
  auto rank0 = make_net(Model::kBuffered, 40);
  spawn_ranks(3, [&](Group& group) {
    DistributedDataParallel ddp(nets[group.rank()], DistributedDataParallelOptions(group));
    expect_same_state(*nets[group.rank()], *rank0, 0);
  });
}

TEST(DdpTest, DifferentShapesAreAnErrorNamingTheParameterOnEachRank) {
  torch::manual_seed(0);
  std::vector<std::shared_ptr<Net>> nets{std::make_shared<Mlp>(8), std::make_shared<Mlp>(8), std::make_shared<Mlp>(9)};
  spawn_ranks(3, [&](Group& group) {
    const auto message = error_of([&] { DistributedDataParallel ddp(nets[group.rank()], group); });
    EXPECT_THAT(message, HasSubstr("DistributedDataParallel rank " + std::to_string(group.rank()) + "/3"));
    EXPECT_THAT(message, HasSubstr("the replicas differ"));
    EXPECT_THAT(message, HasSubstr("rank 0 has parameter 'fc1.weight' float32[8, 4], rank 2 has parameter "
                                   "'fc1.weight' float32[9, 4]"));
    // Rank 1 agrees with rank 0 and is not blamed.
    EXPECT_THAT(message, ::testing::Not(HasSubstr("rank 1 has")));
    // The group still works afterwards (nothing mismatched reached Gloo).
    std::vector<Tensor> t{torch::ones({2})};
    group.transport().allreduce(t)->wait();
    EXPECT_TRUE(torch::equal(t[0], torch::full({2}, 3.0)));
  });
}

TEST(DdpTest, MissingParameterIsAnErrorNamingIt) {
  torch::manual_seed(0);
  std::vector<std::shared_ptr<Net>> nets{std::make_shared<TwoHeads>(), std::make_shared<Mlp>()};
  spawn_ranks(2, [&](Group& group) {
    const auto message = error_of([&] { DistributedDataParallel ddp(nets[group.rank()], group); });
    EXPECT_THAT(message, HasSubstr("rank 0 has parameter 'head2.weight' float32[2, 8], rank 1 has nothing"));
  });
}

TEST(DdpTest, BadOptionsAreErrors) {
  spawn_ranks(1, [&](Group& group) {
    auto net = std::make_shared<Mlp>();
    EXPECT_THAT(error_of([&] { DistributedDataParallel(net, DistributedDataParallelOptions(group).bucket_cap_mb(0)); }),
                HasSubstr("bucket sizes must be positive"));
    DistributedDataParallel ddp(net, group);
    EXPECT_THAT(error_of([&] { ddp.register_comm_hook(CommHook()); }), HasSubstr("the hook is empty"));
    DistributedDataParallel moved(std::move(ddp));
    EXPECT_THAT(error_of([&] { ddp.buckets(); }), HasSubstr("used after it was moved from"));
    EXPECT_EQ(moved.buckets().size(), 1u);
  });
}

// ---------------------------------------------------------------------------
// Buckets.

TEST(DdpTest, BucketsFollowReverseRegistrationOrderAndCaps) {
  spawn_ranks(1, [&](Group& group) {
    auto net = std::make_shared<Mlp>();  // fc1 4x8, fc2 8x8, fc3 8x2 (float32)
    net->register_parameter("scale", torch::ones({3}, torch::kDouble));
    // 1-byte first bucket: it closes after one tensor; then >= 300 bytes.
    DistributedDataParallel ddp(net, DistributedDataParallelOptions(group)
                                         .first_bucket_cap_mb(1.0 / (1024 * 1024))
                                         .bucket_cap_mb(300.0 / (1024 * 1024)));
    const auto buckets = ddp.buckets();
    // named_parameters() lists the module's own "scale" first, so it comes
    // last in reverse order, in a bucket of its own dtype.
    ASSERT_EQ(buckets.size(), 4u);
    EXPECT_EQ(buckets[0].names, std::vector<std::string>{"fc3.bias"});
    EXPECT_EQ(buckets[1].names, (std::vector<std::string>{"fc3.weight", "fc2.bias", "fc2.weight"}));
    EXPECT_EQ(buckets[1].numel, 16 + 8 + 64);
    EXPECT_EQ(buckets[1].dtype, torch::kFloat);
    EXPECT_EQ(buckets[2].names, (std::vector<std::string>{"fc1.bias", "fc1.weight"}));
    EXPECT_EQ(buckets[3].names, std::vector<std::string>{"scale"});
    EXPECT_EQ(buckets[3].dtype, torch::kDouble);
    // Defaults: 1 MiB first bucket, 25 MiB after: one bucket per dtype here.
    auto net2 = std::make_shared<Mlp>();
    EXPECT_EQ(DistributedDataParallel(net2, group).buckets().size(), 1u);
  });
}

TEST(DdpTest, OwnBucketParametersSitAlone) {
  spawn_ranks(1, [&](Group& group) {
    auto net = std::make_shared<Mlp>();  // fc1 4x8, fc2 8x8, fc3 8x2 (float32)
    DistributedDataParallel ddp(net, DistributedDataParallelOptions(group).own_bucket({"fc2.weight"}));
    const auto buckets = ddp.buckets();
    // It closes the bucket before it, so the buckets stay in gradient order.
    ASSERT_EQ(buckets.size(), 3u);
    EXPECT_EQ(buckets[0].names, (std::vector<std::string>{"fc3.bias", "fc3.weight", "fc2.bias"}));
    EXPECT_EQ(buckets[1].names, std::vector<std::string>{"fc2.weight"});
    EXPECT_EQ(buckets[2].names, (std::vector<std::string>{"fc1.bias", "fc1.weight"}));
    EXPECT_THAT(
        error_of([&] { DistributedDataParallel(net, DistributedDataParallelOptions(group).own_bucket({"fc9"})); }),
        HasSubstr("own_bucket names 'fc9', which is not a trainable parameter of the module"));
  });
}

TEST(DdpTest, PaddedBucketsAndReleasedGradientsLiveOnlyInTheHook) {
  // bucket_multiple pads every buffer; release_gradients leaves no .grad()
  // after backward, the hook's result being the only copy, with at most two
  // buckets in flight when the next one is launched.
  spawn_ranks(3, [&](Group& group) {
    torch::manual_seed(3);
    auto plain_net = std::make_shared<Mlp>();
    auto released_net = std::make_shared<Mlp>();
    {
      torch::NoGradGuard no_grad;  // the same start (the seed is shared by the rank threads)
      auto from = plain_net->parameters();
      auto to = released_net->parameters();
      for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
    }
    const auto options = DistributedDataParallelOptions(group)
                             .first_bucket_cap_mb(1.0 / (1024 * 1024))
                             .bucket_cap_mb(30.0 / (1024 * 1024))  // one parameter per bucket
                             .bucket_multiple(3);
    DistributedDataParallel plain(plain_net, options);
    DistributedDataParallel released(released_net, DistributedDataParallelOptions(options).release_gradients(true));
    const auto buckets = released.buckets();
    ASSERT_EQ(buckets.size(), 6u);
    for (const auto& b : buckets) {
      EXPECT_EQ(b.padded_numel % 3, 0) << b.padded_numel;
      EXPECT_GE(b.padded_numel, b.numel);
      EXPECT_LT(b.padded_numel, b.numel + 3);
    }
    std::vector<Tensor> sums(buckets.size());
    int in_flight = 0, most_in_flight = 0;
    auto all_reduce = allreduce_hook();
    released.register_comm_hook([&](GradBucket& bucket) {
      most_in_flight = std::max(most_in_flight, in_flight++);
      auto work = all_reduce(bucket);
      auto buffer = bucket.buffer();
      const size_t index = bucket.index();
      return CommWork{work.pending, [&, buffer, index] {
                        --in_flight;
                        sums[index] = buffer.clone();
                      }};
    });
    const auto x = torch::randn({6, 4});
    for (int step = 0; step < 2; ++step) {
      plain_net->zero_grad();
      plain_net->forward(x.chunk(3, 0)[group.rank()]).sum().backward();
      released_net->forward(x.chunk(3, 0)[group.rank()]).sum().backward();
      for (const auto& p : released_net->parameters()) EXPECT_FALSE(p.grad().defined());
      EXPECT_LE(most_in_flight, 2);
      auto plain_params = plain_net->named_parameters();
      for (size_t b = 0; b < buckets.size(); ++b) {
        ASSERT_TRUE(sums[b].defined()) << "bucket " << b;
        ASSERT_EQ(sums[b].numel(), buckets[b].padded_numel);
        std::vector<Tensor> want;
        for (const auto& name : buckets[b].names) want.push_back(plain_params[name].grad().reshape({-1}));
        EXPECT_TRUE(torch::equal(sums[b].narrow(0, 0, buckets[b].numel), torch::cat(want))) << "bucket " << b;
        EXPECT_EQ(
            sums[b].narrow(0, buckets[b].numel, buckets[b].padded_numel - buckets[b].numel).abs().sum().item<float>(),
            0);
      }
    }
    EXPECT_THAT(
        error_of([&] { DistributedDataParallel(plain_net, DistributedDataParallelOptions(group).bucket_multiple(0)); }),
        HasSubstr("bucket_multiple must be at least 1"));
  });
}

TEST(DdpTest, GradientsAreBucketViewsAndSurviveZeroGrad) {
  spawn_ranks(2, [&](Group& group) {
    torch::manual_seed(1);
    auto net = std::make_shared<Mlp>();
    DistributedDataParallel ddp(net, group);
    torch::optim::SGD opt(net->parameters(), 0.1);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      net->forward(torch::ones({2, 4})).sum().backward();
      opt.step();
    }
    // All gradients live in the one bucket, back to back.
    const auto* first = net->fc3->bias.grad().data_ptr<float>();
    EXPECT_EQ(net->fc3->weight.grad().data_ptr<float>(), first + 2);
    EXPECT_FALSE(net->fc3->weight.grad().is_view());
  });
}

// ---------------------------------------------------------------------------
// no_sync and overlap.

TEST(DdpTest, NoSyncAccumulationEqualsOneBigBatch) {
  const int micro = 4;
  const auto data = make_data(micro, 11);
  auto reference = make_net(Model::kMlp, 3);
  for (int m = 0; m < micro; ++m) torch::mse_loss(reference->forward(data.x[m]), data.y[m]).backward();
  std::vector<std::shared_ptr<Net>> nets{make_net(Model::kMlp, 3), make_net(Model::kMlp, 4)};
  spawn_ranks(2, [&](Group& group) {
    auto& net = nets[group.rank()];
    DistributedDataParallel ddp(net, DistributedDataParallelOptions(group).bucket_cap_mb(0.0002));
    std::atomic<int> reductions{0};
    auto plain = allreduce_hook();
    ddp.register_comm_hook([&](GradBucket& b) {
      ++reductions;
      return plain(b);
    });
    auto micro_loss = [&](int m) {
      return torch::mse_loss(net->forward(shard(data.x[m], group.rank(), 2)), shard(data.y[m], group.rank(), 2));
    };
    {
      auto guard = ddp.no_sync();
      for (int m = 0; m < micro - 1; ++m) micro_loss(m).backward();
    }
    EXPECT_EQ(reductions.load(), 0);  // nothing was communicated
    micro_loss(micro - 1).backward();
    EXPECT_EQ(reductions.load(), static_cast<int>(ddp.buckets().size()));
    auto want = reference->named_parameters();
    for (const auto& p : net->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value().grad(), want[p.key()].grad(), 1e-9, 1e-12)) << p.key();
    }
  });
}

// Identity forward; backward waits (up to 5 s) until the first bucket's
// all-reduce has completed, and records whether it did: a bucket that
// completes while backward is still inside the model overlaps with it.
struct WaitForBucket : torch::autograd::Function<WaitForBucket> {
  static Tensor forward(torch::autograd::AutogradContext*, const Tensor& x) { return x.clone(); }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*, torch::autograd::tensor_list grads);
};
thread_local std::function<bool()> bucket0_done;
thread_local bool overlapped = false;
torch::autograd::tensor_list WaitForBucket::backward(torch::autograd::AutogradContext*,
                                                     torch::autograd::tensor_list grads) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!(overlapped = bucket0_done()) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return grads;
}

TEST(DdpTest, BucketAllReducesCompleteWhileBackwardIsStillRunning) {
  spawn_ranks(2, [&](Group& group) {
    torch::manual_seed(2);
    auto net = std::make_shared<Mlp>();
    // fc3 and fc2 in early buckets, fc1 last.
    DistributedDataParallel ddp(net, DistributedDataParallelOptions(group)
                                         .first_bucket_cap_mb(1.0 / (1024 * 1024))
                                         .bucket_cap_mb(100.0 / (1024 * 1024)));
    std::vector<std::string> events;
    ops::raw::Pending first_work;
    auto plain = allreduce_hook();
    ddp.register_comm_hook([&](GradBucket& b) {
      events.push_back("launch bucket " + std::to_string(b.index()));
      auto work = plain(b);
      if (b.index() == 0) first_work = work.pending;
      return work;
    });
    bucket0_done = [&] { return first_work.defined() && first_work.is_completed(); };
    // The wait sits between fc1 and fc2: backward reaches it after fc3's and
    // fc2's gradients, before fc1's.
    auto x = torch::randn({4, 4}, torch::requires_grad());
    x.register_hook([&](Tensor g) {
      events.push_back("input gradient");
      return g;
    });
    auto h = torch::tanh(net->fc1(x));
    h = WaitForBucket::apply(h);
    auto out = net->fc3(torch::tanh(net->fc2(h)));
    out.sum().backward();
    EXPECT_TRUE(overlapped) << "bucket 0 did not complete before backward reached fc1";
    // Buckets 0 and 1 started before backward reached the model's input.
    ASSERT_GE(events.size(), 4u);
    EXPECT_EQ(events[0], "launch bucket 0");
    EXPECT_EQ(events[1], "launch bucket 1");
    EXPECT_NE(std::find(events.begin() + 2, events.end(), "input gradient"), events.end());
    const auto stats = ddp.last_step();
    EXPECT_GE(stats.buckets, 3);
    EXPECT_EQ(stats.launched_in_backward, stats.buckets);
  });
}

// ---------------------------------------------------------------------------
// Unused parameters.

TEST(DdpTest, UnusedParameterIsAnErrorNamingItAndRanksStayInStep) {
  spawn_ranks(2, [&](Group& group) {
    torch::manual_seed(3);
    auto net = std::make_shared<TwoHeads>();
    DistributedDataParallel ddp(net, group);
    const auto message = error_of([&] { net->forward_heads(torch::ones({2, 4}), false).sum().backward(); });
    EXPECT_THAT(message, HasSubstr("DistributedDataParallel rank " + std::to_string(group.rank()) + "/2"));
    EXPECT_THAT(message, HasSubstr("parameter 'head2.bias' received no gradient in this backward"));
    EXPECT_THAT(message, HasSubstr("'head2.weight'"));
    EXPECT_THAT(message, HasSubstr("find_unused_parameters(true)"));
    // The next backward that uses everything works.
    net->zero_grad();
    net->forward_heads(torch::ones({2, 4}), true).sum().backward();
    EXPECT_TRUE(net->head2->weight.grad().defined());
  });
}

TEST(DdpTest, ParameterUnusedOnOneRankIsAnErrorThereAndNoHangAnywhere) {
  spawn_ranks(2, [&](Group& group) {
    torch::manual_seed(3);
    auto net = std::make_shared<TwoHeads>();
    DistributedDataParallel ddp(net, group);
    const bool use_head2 = group.rank() == 1;
    const auto message = error_of([&] { net->forward_heads(torch::ones({2, 4}), use_head2).sum().backward(); });
    if (use_head2) {
      EXPECT_EQ(message, "(no error)");
    } else {
      EXPECT_THAT(message, HasSubstr("parameter 'head2.bias' received no gradient in this backward"));
    }
    // Both ranks completed the same collectives: the next step works.
    net->zero_grad();
    net->forward_heads(torch::ones({2, 4}), true).sum().backward();
    EXPECT_TRUE(torch::equal(net->head2->bias.grad(), torch::full({2}, 2.0f)));
  });
}

TEST(DdpTest, FindUnusedParametersHandlesRankDependentUse) {
  // Rank 0 never uses head2 and rank 1 does; nobody uses it in step 2.
  const auto data = make_data(1, 13);
  torch::manual_seed(6);
  auto reference = std::make_shared<TwoHeads>();
  reference->to(torch::kDouble);
  auto loss_of = [&](TwoHeads& net, int rank) {
    return torch::mse_loss(net.forward_heads(shard(data.x[0], rank, 2), rank == 1), shard(data.y[0], rank, 2));
  };
  ((loss_of(*reference, 0) + loss_of(*reference, 1)) / 2).backward();
  std::vector<std::shared_ptr<TwoHeads>> nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(6);
    nets.push_back(std::make_shared<TwoHeads>());
    nets.back()->to(torch::kDouble);
  }
  spawn_ranks(2, [&](Group& group) {
    auto& net = nets[group.rank()];
    DistributedDataParallel ddp(net, DistributedDataParallelOptions(group).find_unused_parameters(true));
    loss_of(*net, group.rank()).backward();
    auto want = reference->named_parameters();
    for (const auto& p : net->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value().grad(), want[p.key()].grad(), 1e-9, 1e-12)) << p.key();
    }
    EXPECT_EQ(ddp.last_step().unused_parameters.size(), group.rank() == 0 ? 2u : 0u);
    // Unused everywhere: the gradient stays undefined (optimizers skip it).
    net->zero_grad(/*set_to_none=*/true);
    net->forward_heads(torch::ones({2, 4}, torch::kDouble), false).sum().backward();
    EXPECT_FALSE(net->head2->weight.grad().defined());
    EXPECT_TRUE(net->fc1->weight.grad().defined());
  });
}

TEST(DdpTest, ParameterUsedOnlyUnderNoSyncIsNotAnError) {
  spawn_ranks(2, [&](Group& group) {
    torch::manual_seed(4);
    auto net = std::make_shared<TwoHeads>();
    DistributedDataParallel ddp(net, group);
    {
      auto guard = ddp.no_sync();
      net->forward_heads(torch::ones({2, 4}), true).sum().backward();
    }
    net->forward_heads(torch::ones({2, 4}), false).sum().backward();  // head2: accumulated, reduced
    EXPECT_TRUE(net->head2->weight.grad().defined());
  });
}

// ---------------------------------------------------------------------------
// Communication hooks.

class DdpHooks : public ::testing::TestWithParam<std::string> {};

TEST_P(DdpHooks, CompressionHooksMatchThePlainAllReduce) {
  const auto backend = GetParam();
  if (!have_backend(backend)) GTEST_SKIP() << "backend " << backend << " is not in this build";
  const auto data = make_data(1, 17, torch::kFloat);
  for (int hook = 0; hook < 2; ++hook) {
    std::vector<std::shared_ptr<Net>> plain_nets, nets;
    for (int r = 0; r < 3; ++r) {
      plain_nets.push_back(make_net(Model::kMlp, 8, torch::kFloat));
      nets.push_back(make_net(Model::kMlp, 8, torch::kFloat));
    }
    spawn_ranks(
        3,
        [&](Group& group) {
          const int r = group.rank();
          DistributedDataParallel plain(plain_nets[r], group);
          DistributedDataParallel compressed(nets[r], DistributedDataParallelOptions(group).bucket_cap_mb(0.0002));
          compressed.register_comm_hook(hook == 0 ? fp16_compress_hook() : bf16_compress_hook());
          for (auto* net : {plain_nets[r].get(), nets[r].get()}) {
            torch::mse_loss(net->forward(shard(data.x[0], r, 3)), shard(data.y[0], r, 3)).backward();
          }
          auto want = plain_nets[r]->named_parameters();
          // Relative to the largest gradient of the tensor: 16-bit rounding of
          // each rank's terms (2^-11 for fp16, 2^-8 for bf16), a few terms each.
          const double tol = hook == 0 ? 2e-3 : 1.5e-2;
          for (const auto& p : nets[r]->named_parameters()) {
            const auto& g = p.value().grad();
            const auto& w = want[p.key()].grad();
            EXPECT_EQ(g.scalar_type(), torch::kFloat);
            EXPECT_LE((g - w).abs().max().item<double>(), tol * w.abs().max().item<double>())
                << (hook == 0 ? "fp16 " : "bf16 ") << p.key();
          }
        },
        SpawnOptions().backend(backend));
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, DdpHooks, ::testing::Values("gloo", "shm"));

// 16-bit buckets go through ops::raw::all_reduce_ on every transport (in
// float32 on Gloo, natively on shm): exact for small integers either way.
TEST(DdpTest, SixteenBitBucketsSumExactlyOnEveryTransport) {
  for (const char* backend : {"gloo", "shm"}) {
    for (int n : {2, 3}) {
      spawn_ranks(
          n,
          [&](Group& group) {
            for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
              for (int64_t numel : {1, 5, 17}) {
                auto values = (torch::arange(numel) % 7 + group.rank()).to(dtype);
                GradBucket bucket(0, 1, values, {values}, {"v"}, group);
                auto work = allreduce_hook()(bucket);
                if (work.pending.defined()) work.pending.wait();
                if (work.then) work.then();
                const auto want = (torch::arange(numel) % 7) * n + n * (n - 1) / 2;
                EXPECT_TRUE(torch::equal(values.to(torch::kLong), want))
                    << backend << " " << dtype << " numel " << numel;
              }
            }
          },
          SpawnOptions().backend(backend));
    }
  }
}

TEST(DdpTest, Bfloat16ParametersAreReducedOnGloo) {
  spawn_ranks(2, [&](Group& group) {
    auto net = std::make_shared<torch::nn::Module>();
    auto w = net->register_parameter("w", torch::ones({5}, torch::kBFloat16));
    DistributedDataParallel ddp(net, group);
    (w * (group.rank() + 1)).sum().backward();  // local grads 1 and 2
    EXPECT_TRUE(torch::equal(w.grad().to(torch::kFloat), torch::full({5}, 1.5f)));
  });
}

// DDP's collectives are ops::raw collectives: numbered in their group (one
// per bucket) and, with the debug check on, checked across ranks like any
// other, so a hook that disagrees between ranks is an error on both.
TEST(DdpTest, BucketReductionsAreRawCollectives) {
  spawn_ranks(2, [&](Group& group) {
    torch::manual_seed(3);
    auto net = std::make_shared<Mlp>();
    DistributedDataParallel ddp(net, DistributedDataParallelOptions(group)
                                         .broadcast_buffers(false)
                                         .first_bucket_cap_mb(1.0 / (1024 * 1024))
                                         .bucket_cap_mb(100.0 / (1024 * 1024)));
    const uint64_t before = group.state()->sequence.load();
    net->forward(torch::randn({4, 4})).sum().backward();
    EXPECT_GE(ddp.last_step().buckets, 3);
    EXPECT_EQ(static_cast<int64_t>(group.state()->sequence.load() - before), ddp.last_step().buckets);
  });
}

TEST(DdpTest, DebugCheckCatchesHooksThatDisagreeAcrossRanks) {
  ops::set_debug_checks(true);
  spawn_ranks(2, [&](Group& group) {
    auto net = std::make_shared<torch::nn::Module>();
    auto w = net->register_parameter("w", torch::ones({6}));
    DistributedDataParallel ddp(net, group);
    ddp.register_comm_hook([&](GradBucket& b) {
      auto part = b.buffer().narrow(0, 0, group.rank() == 0 ? 6 : 3);  // rank 1's hook is wrong
      return CommWork{ops::raw::all_reduce_(part, {}, b.group()), nullptr};
    });
    const auto message = error_of([&] { (w * 2).sum().backward(); });
    EXPECT_THAT(message, HasSubstr("ranks disagree on collective #"));
    EXPECT_THAT(message, HasSubstr("all_reduce(float32[6], op=sum)"));
    EXPECT_THAT(message, HasSubstr("all_reduce(float32[3], op=sum)"));
  });
  ops::set_debug_checks(std::nullopt);
}

}  // namespace
}  // namespace commgrad::testing
