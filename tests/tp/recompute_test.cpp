// Tests of activation recomputation (tp/recompute.h): PyTorch's
// test_checkpoint_rng_cpu in C++ (gradients with recompute equal those
// without, bit for bit, through dropouts of LibTorch's generator and of the
// TP tracker's model-parallel stream), the cost of full recompute counted
// matmul by matmul against the closed form (torchtitan's test_flops idea),
// several inputs and outputs with a non-grad input and non-tensor
// arguments, undeclared parameters, DDP's hooks and fully_shard's, the
// recompute option of ParallelTransformerLayer at TP = 2 (selective and
// full, with and without sequence parallelism, collectives counted), and
// the errors.

#include "harness/expect_error.h"
#include "commgrad/dp/distributed_data_parallel.h"
#include "commgrad/fsdp/fully_shard.h"
#include "commgrad/tp/random.h"
#include "commgrad/tp/recompute.h"
#include "commgrad/tp/transformer_layer.h"
#include "commgrad/tp/weight_gradients.h"

#include "harness/spawn_ranks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::tp {
namespace {

using commgrad::testing::error_of;
using commgrad::testing::spawn_ranks;
using ::testing::HasSubstr;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A tracker with both streams, installed as this thread's.
RngTracker seeded_tracker(uint64_t seed) {
  RngTracker tracker;
  tracker.manual_seed(seed);
  tracker.add(kModelParallelRng, seed + kTensorParallelSeedOffset);
  return tracker;
}

// Parameters from a generator of their own (ranks are threads and share
// LibTorch's default generator, so torch::manual_seed alone does not make
// two runs start alike).
void init_parameters(torch::nn::Module& module, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& p : module.parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
}

// ~~~ PyTorch's test_checkpoint_rng_cpu ~~~

// One iteration: dropout (LibTorch's generator), then fn = dropout
// (LibTorch's generator) + dropout (the tracker's model-parallel stream),
// recomputed or not; sum; backward. Returns the input's gradient and one
// draw of each stream made after backward (recompute must put them back).
struct RngRun {
  at::Tensor grad, cpu_after, tracker_after;
};

RngRun rng_run(bool use_recompute, bool fork_outside, const at::Tensor& input) {
  auto tracker = rng_tracker();
  auto fn = [&](const at::Tensor& x) {
    auto a = torch::dropout(x, 0.5, /*train=*/true);
    if (fork_outside) return tp::dropout(a, 0.5, true);
    auto guard = tracker.fork();
    return tp::dropout(a, 0.5, true);
  };
  auto inp = input.clone().requires_grad_(true);
  auto out = torch::dropout(inp, 0.5, true);  // phase 1
  {
    std::optional<RngFork> outer;
    if (fork_outside) outer.emplace(tracker.fork());
    out = use_recompute ? tp::recompute(fn, out, RecomputeOptions().name("phase2")) : fn(out);
  }
  torch::randn({7});  // streams move on between forward and backward
  tp::dropout(torch::ones({7}), 0.5, true);
  out.sum().backward();
  return {inp.grad(), torch::randn({5}), tp::dropout(torch::ones({5}), 0.5, true)};
}

void expect_rng_replayed(bool fork_outside) {
  for (int iteration = 0; iteration < 5; ++iteration) {
    const auto input = torch::randn({20000});
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    const auto cpu_state = cpu.get_state();
    ScopedRngTracker scoped(seeded_tracker(100 + iteration));
    const RngRun with = rng_run(/*use_recompute=*/true, fork_outside, input);
    cpu.set_state(cpu_state);
    ScopedRngTracker again(seeded_tracker(100 + iteration));
    const RngRun without = rng_run(/*use_recompute=*/false, fork_outside, input);
    EXPECT_TRUE(torch::equal(with.grad, without.grad)) << "iteration " << iteration;
    EXPECT_TRUE(torch::equal(with.cpu_after, without.cpu_after)) << "iteration " << iteration;
    EXPECT_TRUE(torch::equal(with.tracker_after, without.tracker_after)) << "iteration " << iteration;
    // Three dropouts of p = 1/2 really dropped: about 7/8 of the gradient is 0.
    const double zeros = (with.grad == 0).sum().item<double>() / 20000.0;
    EXPECT_NEAR(zeros, 0.875, 0.02);
  }
}

TEST(Recompute, CheckpointRngCpuGradientsEqualBitForBit) {
  torch::manual_seed(0);
  expect_rng_replayed(/*fork_outside=*/false);
}

TEST(Recompute, ReplaysTheForkTheFunctionRanUnder) {
  torch::manual_seed(1);
  expect_rng_replayed(/*fork_outside=*/true);
}

TEST(Recompute, WithoutReplayTheMasksDiffer) {
  torch::manual_seed(2);
  ScopedRngTracker scoped(seeded_tracker(5));
  auto x = torch::ones({1000}, torch::requires_grad());
  auto fn = [](const at::Tensor& in) { return torch::dropout(in, 0.5, true); };
  auto y = tp::recompute(fn, x, RecomputeOptions().preserve_rng_state(false));
  const auto kept = (y != 0);
  y.sum().backward();
  EXPECT_FALSE(torch::equal(x.grad() != 0, kept));
}

// ~~~ the cost count ~~~

// Matmuls (and their flops) done by CountedLinear since the last reset.
struct MatmulCount {
  int64_t forward = 0, backward = 0, forward_flops = 0, backward_flops = 0;
};
thread_local MatmulCount t_count;

int64_t matmul_flops(const at::Tensor& a, const at::Tensor& b) { return 2 * a.size(0) * a.size(1) * b.size(1); }

// y = x W^T + b, with one counted matmul in forward and one per needed
// gradient (x, W) in backward.
struct CountedLinearFunction : torch::autograd::Function<CountedLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    ctx->save_for_backward({x, w});
    ++t_count.forward;
    t_count.forward_flops += matmul_flops(x, w.t());
    return torch::addmm(b, x, w.t());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &g = grads[0];
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      gx = g.mm(w);
      ++t_count.backward;
      t_count.backward_flops += matmul_flops(g, w);
    }
    if (ctx->needs_input_grad(1)) {
      gw = g.t().mm(x);
      ++t_count.backward;
      t_count.backward_flops += matmul_flops(g.t(), x);
    }
    return {gx, gw, ctx->needs_input_grad(2) ? g.sum(0) : at::Tensor()};
  }
};

struct CountedLinearImpl : torch::nn::Module {
  CountedLinearImpl(int64_t in, int64_t out) : linear(register_module("linear", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return CountedLinearFunction::apply(x, linear->weight, linear->bias); }
  torch::nn::Linear linear;
};
TORCH_MODULE(CountedLinear);

struct ThreeLinears : torch::nn::Module {
  CountedLinear a = register_module("a", CountedLinear(512, 512));
  CountedLinear b = register_module("b", CountedLinear(512, 512));
  CountedLinear c = register_module("c", CountedLinear(512, 1024));
  at::Tensor forward(const at::Tensor& x) { return c->forward(b->forward(a->forward(x))); }
};

struct CostRun {
  MatmulCount forward, backward;  // counted during forward, during backward
  std::vector<at::Tensor> grads;
};

CostRun cost_run(bool use_recompute, bool declare) {
  torch::manual_seed(3);
  auto model = std::make_shared<ThreeLinears>();
  const auto x = torch::randn({512, 512});  // no grad, as torchtitan's test_flops
  t_count = {};
  auto fn = [&](const at::Tensor& in) { return model->forward(in); };
  auto options = RecomputeOptions().name("three linears");
  if (declare) options.parameters(model->parameters());
  auto y = use_recompute ? tp::recompute(fn, x, options) : fn(x);
  CostRun run;
  run.forward = t_count;
  t_count = {};
  y.pow(2).sum().backward();
  run.backward = t_count;
  for (const auto& p : model->parameters()) run.grads.push_back(p.grad());
  return run;
}

TEST(Recompute, FullRecomputeCostsOneMoreForwardInBackward) {
  // Closed form: forward matmuls 3; backward 2 per linear except the input
  // gradient of the first (x needs none): 5; full recompute adds the 3
  // forward matmuls to backward.
  const int64_t m = 512;
  const int64_t forward_flops = 2 * m * (512 * 512 + 512 * 512 + 512 * 1024);
  const int64_t backward_flops = 2 * forward_flops - 2 * m * 512 * 512;
  const CostRun none = cost_run(false, false);
  EXPECT_EQ(none.forward.forward, 3);
  EXPECT_EQ(none.forward.forward_flops, forward_flops);
  EXPECT_EQ(none.backward.forward, 0);
  EXPECT_EQ(none.backward.backward, 5);
  EXPECT_EQ(none.backward.backward_flops, backward_flops);
  for (bool declare : {true, false}) {
    const CostRun full = cost_run(true, declare);
    EXPECT_EQ(full.forward.forward, 3) << "declare " << declare;
    EXPECT_EQ(full.forward.backward, 0);
    EXPECT_EQ(full.backward.forward, 3) << "the one extra forward";
    EXPECT_EQ(full.backward.forward_flops, forward_flops);
    EXPECT_EQ(full.backward.backward, 5);
    EXPECT_EQ(full.backward.backward_flops, backward_flops);
    EXPECT_EQ(full.backward.forward + full.backward.backward, none.backward.backward + 3);
    ASSERT_EQ(full.grads.size(), none.grads.size());
    for (size_t i = 0; i < full.grads.size(); ++i) {
      ASSERT_TRUE(full.grads[i].defined()) << "parameter " << i << ", declare " << declare;
      EXPECT_TRUE(torch::equal(full.grads[i], none.grads[i])) << "parameter " << i << ", declare " << declare;
    }
  }
}

// ~~~ several inputs and outputs ~~~

TEST(Recompute, SeveralInputsAndOutputsNonGradInputAndNonTensorArguments) {
  torch::manual_seed(4);
  const auto a0 = torch::randn({4, 3}), b0 = torch::randn({3, 5}), c0 = torch::randn({4, 5});
  const auto index = torch::tensor({2, 0, 1}, torch::kLong);
  auto w = torch::randn({5}, torch::requires_grad());  // a captured leaf (undeclared)
  const double scale = 0.5;                            // a non-tensor argument
  auto fn = [&](const std::vector<at::Tensor>& in) {
    auto prod = in[0].mm(in[1]);  // a @ b
    auto first = torch::tanh(prod * scale + in[2]) * w;
    auto second = prod.index_select(1, in[3]).sin();                  // uses the integer input
    return std::vector<at::Tensor>{first, second, in[3] + 1, in[0]};  // an integer output, an input itself
  };
  for (bool use_second : {true, false}) {
    std::vector<at::Tensor> grads[2];
    for (bool use_recompute : {false, true}) {
      auto a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true), c = c0.clone();
      w.mutable_grad() = at::Tensor();
      std::vector<at::Tensor> in{a, b, c, index};
      auto out = use_recompute ? tp::recompute(fn, in, RecomputeOptions().name("two outputs")) : fn(in);
      ASSERT_EQ(out.size(), 4u);
      EXPECT_FALSE(out[2].requires_grad());
      EXPECT_TRUE(torch::equal(out[2], index + 1));
      auto loss = out[0].pow(2).sum() + out[3].sum() * 3;
      if (use_second) loss = loss + out[1].sum();
      loss.backward();
      EXPECT_FALSE(c.grad().defined());
      grads[use_recompute] = {a.grad(), b.grad(), w.grad()};
    }
    for (size_t i = 0; i < 3; ++i) {
      ASSERT_TRUE(grads[1][i].defined()) << i;
      EXPECT_TRUE(torch::equal(grads[1][i], grads[0][i])) << "gradient " << i << " use_second " << use_second;
    }
  }
}

TEST(Recompute, OutsideGradModeItIsAPlainCall) {
  torch::NoGradGuard no_grad;
  int calls = 0;
  auto x = torch::ones({2}, torch::requires_grad());
  auto y = tp::recompute(
      [&](const at::Tensor& in) {
        ++calls;
        return in * 2;
      },
      x);
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(y.requires_grad());
}

// ~~~ DDP ~~~

struct Stack : torch::nn::Module {
  torch::nn::Linear first = register_module("first", torch::nn::Linear(6, 8));
  torch::nn::Linear middle = register_module("middle", torch::nn::Linear(8, 8));
  torch::nn::Linear last = register_module("last", torch::nn::Linear(8, 2));
  bool recompute_middle = false;
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(first->forward(x));
    auto fn = [this](const at::Tensor& in) { return torch::gelu(middle->forward(in)); };
    h = recompute_middle ? tp::recompute(fn, h, RecomputeOptions().name("middle").parameters(middle->parameters()))
                         : fn(h);
    return last->forward(h);
  }
};

TEST(Recompute, DdpSeesEachDeclaredGradientOnceInTheOuterBackward) {
  spawn_ranks(2, [](Group& world) {
    std::vector<at::Tensor> grads[2];
    for (bool use_recompute : {false, true}) {
      auto model = std::make_shared<Stack>();
      init_parameters(*model, 5);
      model->recompute_middle = use_recompute;
      dp::DistributedDataParallel ddp(model, dp::DistributedDataParallelOptions(world));
      for (int step = 0; step < 2; ++step) {
        for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
        auto gen = at::detail::createCPUGenerator(10 * step + world.rank());
        auto x = torch::randn({4, 6}, gen);
        model->forward(x).pow(2).sum().backward();
      }
      for (const auto& p : model->parameters()) grads[use_recompute].push_back(p.grad().clone());
    }
    for (size_t i = 0; i < grads[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(grads[1][i], grads[0][i])) << "parameter " << i;
    }
  });
}

// ~~~ fully_shard ~~~

// A unit whose forward recomputes its body; its parameters are not declared
// (the tensors its code reads are fully_shard's gathered ones).
struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc1 = register_module("fc1", torch::nn::Linear(6, 12));
  torch::nn::Linear fc2 = register_module("fc2", torch::nn::Linear(12, 6));
  bool use_recompute = false;
  at::Tensor forward(const at::Tensor& x) {
    auto fn = [this](const at::Tensor& in) { return fc2->forward(torch::gelu(fc1->forward(in))); };
    return use_recompute ? tp::recompute(fn, x, RecomputeOptions().name("block")) : fn(x);
  }
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  torch::nn::Linear first = register_module("first", torch::nn::Linear(6, 6));
  Block block = register_module("block", Block());
  torch::nn::Linear head = register_module("head", torch::nn::Linear(6, 2));
  at::Tensor forward(const at::Tensor& x) { return head->forward(fsdp::call(block, torch::relu(first->forward(x)))); }
};
TORCH_MODULE(Net);

TEST(Recompute, InsideAFullyShardUnitGathersNoMoreAndTrainsTheSame) {
  spawn_ranks(2, [](Group& world) {
    std::vector<float> losses[2];
    torch::OrderedDict<std::string, at::Tensor> state[2];
    fsdp::StepStats stats[2];
    for (bool use_recompute : {false, true}) {
      Net net;
      init_parameters(*net, 6);
      net->block->use_recompute = use_recompute;
      fsdp::fully_shard(net->block, world);
      auto sharded = fsdp::fully_shard(net, world);
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
      for (int step = 0; step < 3; ++step) {
        auto gen = at::detail::createCPUGenerator(100 * step + world.rank());
        auto loss = fsdp::call(net, torch::randn({4, 6}, gen)).pow(2).sum();
        loss.backward();
        losses[use_recompute].push_back(loss.item<float>());
        opt.step();
        for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
      }
      state[use_recompute] = sharded.full_state_dict();
      stats[use_recompute] = sharded.last_step();
    }
    EXPECT_EQ(losses[1], losses[0]);
    for (const auto& item : state[0]) EXPECT_TRUE(torch::equal(state[1][item.key()], item.value())) << item.key();
    EXPECT_EQ(stats[1].all_gathers, stats[0].all_gathers);
    EXPECT_EQ(stats[1].all_gathers, 3);  // block: forward and backward; the root keeps its parameters
    EXPECT_EQ(stats[1].reduce_scatters, stats[0].reduce_scatters);
  });
}

// ~~~ ParallelTransformerLayer at TP = 2 ~~~

// One training step of a layer with both dropouts on; collectives counted
// through the group's sequence number (each rank reads it once per phase,
// so the ranks stay in step).
struct LayerRun {
  at::Tensor out, input_grad;
  std::vector<at::Tensor> grads;
  uint64_t forward_collectives = 0, backward_collectives = 0;
  std::vector<at::Tensor> saved;  // what a full recompute kept for the rerun (recompute_saved_inputs)
  bool saved_aliases_input = false;
  size_t deferred = 0;          // with `defer`: weight gradients waiting after backward (B)
  size_t defined_before_w = 0;  // with `defer`: parameter gradients defined after B, before W
};

LayerRun layer_run(Group& g, RecomputeGranularity granularity, bool sequence_parallel, bool defer = false) {
  ScopedRngTracker scoped{RngTracker()};
  model_parallel_manual_seed(77, g);
  ParallelTransformerLayer layer(ParallelTransformerLayerOptions(16, 4, 32, g)
                                     .hidden_dropout(0.2)
                                     .attention_dropout(0.2)
                                     .sequence_parallel(sequence_parallel)
                                     .recompute(granularity)
                                     .seed(9));
  layer->train();
  auto gen = at::detail::createCPUGenerator(123);
  at::Tensor x = torch::randn({8, 2, 16}, gen);
  if (sequence_parallel) x = x.chunk(g.size(), 0)[g.rank()].clone();
  x.requires_grad_(true);
  LayerRun run;
  WeightGradients weights;  // a zero-bubble schedule's: forward under the guard, B, then W
  const uint64_t s0 = g.next_sequence();
  {
    std::optional<DeferWeightGradients> guard;
    if (defer) guard.emplace(weights);
    run.out = layer(x);
  }
  const uint64_t s1 = g.next_sequence();
  run.saved = recompute_saved_inputs(run.out);
  run.saved_aliases_input = run.saved.size() == 1 && run.saved[0].data_ptr() == x.data_ptr();
  run.out.pow(2).sum().backward();
  const uint64_t s2 = g.next_sequence();
  run.deferred = weights.size();
  for (const auto& p : layer->parameters()) run.defined_before_w += p.grad().defined() ? 1 : 0;
  weights.compute();
  run.forward_collectives = s1 - s0 - 1;
  run.backward_collectives = s2 - s1 - 1;
  run.input_grad = x.grad();
  for (const auto& p : layer->parameters()) run.grads.push_back(p.grad());
  return run;
}

void expect_same_gradients(const LayerRun& run, const LayerRun& want, const std::string& what) {
  EXPECT_TRUE(torch::equal(run.out, want.out)) << what;
  EXPECT_TRUE(torch::equal(run.input_grad, want.input_grad)) << what;
  ASSERT_EQ(run.grads.size(), want.grads.size());
  for (size_t i = 0; i < run.grads.size(); ++i) {
    ASSERT_TRUE(run.grads[i].defined()) << what << " parameter " << i;
    EXPECT_TRUE(torch::equal(run.grads[i], want.grads[i])) << what << " parameter " << i;
  }
}

class RecomputeLayer : public ::testing::TestWithParam<bool> {};

TEST_P(RecomputeLayer, GradientsEqualWithoutRecomputeWithDropoutOn) {
  const bool sequence_parallel = GetParam();
  spawn_ranks(2, [&](Group& g) {
    const LayerRun none = layer_run(g, RecomputeGranularity::kNone, sequence_parallel);
    EXPECT_EQ(none.forward_collectives, sequence_parallel ? 4u : 2u);
    EXPECT_TRUE(none.saved.empty());
    for (auto granularity : {RecomputeGranularity::kSelective, RecomputeGranularity::kFull}) {
      const std::string what = recompute_granularity_name(granularity);
      const LayerRun run = layer_run(g, granularity, sequence_parallel);
      expect_same_gradients(run, none, what);
      EXPECT_EQ(run.forward_collectives, none.forward_collectives) << what;
      // Selective: not one collective again; full: the forward's once more.
      const uint64_t extra = granularity == RecomputeGranularity::kFull ? none.forward_collectives : 0;
      EXPECT_EQ(run.backward_collectives, none.backward_collectives + extra) << what;
    }
  });
}

// Full recompute keeps the layer's input only, an alias of it (no copy):
// under sequence parallelism this rank's chunk of the sequence, 1/TP of the
// elements (Megatron's distribute_saved_activations).
TEST_P(RecomputeLayer, FullRecomputeKeepsThisRanksInputOnly) {
  const bool sequence_parallel = GetParam();
  spawn_ranks(2, [&](Group& g) {
    const LayerRun run = layer_run(g, RecomputeGranularity::kFull, sequence_parallel);
    ASSERT_EQ(run.saved.size(), 1u);
    const int64_t whole = 8 * 2 * 16;  // s x b x h
    EXPECT_EQ(run.saved[0].numel(), sequence_parallel ? whole / g.size() : whole);
    EXPECT_TRUE(run.saved_aliases_input);
    EXPECT_TRUE(recompute_saved_inputs(run.out).empty()) << "released after backward";
  });
}

// Under a zero-bubble schedule (forward under DeferWeightGradients, B, W),
// full recompute defers the same 4 weight gradients (qkv, dense, fc1, fc2)
// as the layer without it: none is accumulated in B, all in W, and every
// gradient equals the plain backward's bit for bit.
TEST_P(RecomputeLayer, FullRecomputeDefersTheWeightGradientsToW) {
  const bool sequence_parallel = GetParam();
  spawn_ranks(2, [&](Group& g) {
    const LayerRun plain = layer_run(g, RecomputeGranularity::kNone, sequence_parallel);
    const LayerRun none = layer_run(g, RecomputeGranularity::kNone, sequence_parallel, /*defer=*/true);
    EXPECT_EQ(none.deferred, 4u);
    expect_same_gradients(none, plain, "none, deferred");
    for (auto granularity : {RecomputeGranularity::kSelective, RecomputeGranularity::kFull}) {
      const std::string what = std::string(recompute_granularity_name(granularity)) + ", deferred";
      const LayerRun run = layer_run(g, granularity, sequence_parallel, /*defer=*/true);
      EXPECT_EQ(run.deferred, none.deferred) << what;
      EXPECT_EQ(run.defined_before_w, none.defined_before_w) << what;
      expect_same_gradients(run, plain, what);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(SequenceParallel, RecomputeLayer, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("sp") : std::string("no_sp"); });

TEST(RecomputeLayerPrint, ShowsTheGranularity) {
  spawn_ranks(1, [](Group& g) {
    ParallelTransformerLayer layer(
        ParallelTransformerLayerOptions(8, 2, 16, g).recompute(RecomputeGranularity::kSelective).seed(1));
    EXPECT_THAT(c10::str(*layer), HasSubstr("recompute=selective"));
  });
}

// The head recomputed: the first gradients of the backward come from inside
// recompute. Declared, they reach DDP in the outer backward; undeclared,
// they are accumulated by a nested engine call, DDP's end-of-backward runs
// at its end, and DDP says so (docs/recompute.md).
std::vector<at::Tensor> ddp_head_recomputed(Group& world, bool use_recompute, bool declare) {
  auto model = std::make_shared<Stack>();
  init_parameters(*model, 7);
  dp::DistributedDataParallel ddp(model, dp::DistributedDataParallelOptions(world));
  auto gen = at::detail::createCPUGenerator(world.rank());
  auto h = model->middle->forward(torch::relu(model->first->forward(torch::randn({4, 6}, gen))));
  auto head = [&](const at::Tensor& in) { return model->last->forward(in); };
  auto options = RecomputeOptions().name("head");
  if (declare) options.parameters(model->last->parameters());
  auto y = use_recompute ? tp::recompute(head, h, options) : head(h);
  y.pow(2).sum().backward();
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad());
  return grads;
}

TEST(Recompute, DdpWhenTheFirstGradientsComeFromInsideRecompute) {
  spawn_ranks(2, [](Group& world) {
    const auto expected = ddp_head_recomputed(world, /*use_recompute=*/false, false);
    const auto got = ddp_head_recomputed(world, /*use_recompute=*/true, /*declare=*/true);
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << "parameter " << i;
    EXPECT_THAT(error_of([&] { ddp_head_recomputed(world, /*use_recompute=*/true, /*declare=*/false); }),
                HasSubstr("received no gradient in this backward"));
  });
}

// ~~~ errors ~~~

TEST(RecomputeErrors, OutputShapeDiffersOnRerun) {
  int calls = 0;
  auto x = torch::randn({4, 3}, torch::requires_grad());
  auto fn = [&](const at::Tensor& in) { return ++calls == 1 ? in * 2 : in.narrow(1, 0, 2) * 2; };
  auto y = tp::recompute(fn, x, RecomputeOptions().name("layers.3"));
  EXPECT_THAT(error_of([&] { y.sum().backward(); }),
              HasSubstr("[commgrad] recompute 'layers.3': output 0 was float32[4, 3] on cpu in forward and is "
                        "float32[4, 2] on cpu when recomputed"));
}

// A function that draws dropout from a generator of its own reruns with
// other masks: backward stops, naming the function and the likely cause,
// instead of handing out gradients of masks the forward never used.
// check_rerun(false) lets it through (and the masks then differ).
TEST(RecomputeErrors, RerunThatComputesOtherValues) {
  auto x = torch::ones({1000}, torch::requires_grad());
  auto own = at::make_generator<at::CPUGeneratorImpl>(3);
  auto fn = [&](const at::Tensor& in) { return in * at::bernoulli(at::full_like(in, 0.5), own); };
  auto y = tp::recompute(fn, x, RecomputeOptions().name("layers.2"));
  EXPECT_THAT(error_of([&] { y.sum().backward(); }),
              HasSubstr("[commgrad] recompute 'layers.2': output 0 (float32[1000]) differs when recomputed (its sum "
                        "was "));
  auto z = tp::recompute(fn, x, RecomputeOptions().name("layers.2").check_rerun(false));
  const auto kept = (z != 0);
  z.sum().backward();
  EXPECT_FALSE(torch::equal(x.grad() != 0, kept));
}

TEST(RecomputeErrors, InputModifiedInPlaceBetweenForwardAndBackward) {
  auto x = torch::randn({4}, torch::requires_grad());
  auto h = x * 1;
  auto y = tp::recompute([](const at::Tensor& in) { return in.exp(); }, h, RecomputeOptions().name("block"));
  h.add_(1);
  EXPECT_THAT(error_of([&] { y.sum().backward(); }),
              HasSubstr("[commgrad] recompute 'block': input 0 (float32[4]) was modified in place between forward "
                        "and backward (version 0 -> 1)"));
}

TEST(RecomputeErrors, FunctionModifiesItsInputInPlace) {
  auto x = torch::randn({4}, torch::requires_grad());
  auto h = x * 1;
  auto fn = [](const at::Tensor& in) { return in.mul_(2).exp(); };
  EXPECT_THAT(error_of([&] { tp::recompute(fn, h, RecomputeOptions().name("block")); }),
              HasSubstr("[commgrad] recompute 'block': input 0 (float32[4]) was modified in place by the function "
                        "itself"));
}

TEST(RecomputeErrors, CapturedActivationThatRequiresGrad) {
  auto x = torch::randn({4}, torch::requires_grad());
  auto outside = x.exp();  // computed outside the function, captured by it
  auto y = tp::recompute([&](const at::Tensor& in) { return in * outside; }, torch::ones({4}, torch::requires_grad()),
                         RecomputeOptions().name("block"));
  EXPECT_THAT(error_of([&] { y.sum().backward(); }),
              HasSubstr("[commgrad] recompute 'block': the recomputed graph reaches"));
}

}  // namespace
}  // namespace commgrad::tp
