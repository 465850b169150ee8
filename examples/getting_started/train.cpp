// The program of docs/getting-started.md: a two-layer tensor-parallel MLP
// trained TP x DP with ZeRO-2 and clipping, a checkpoint resumed at another
// layout, and a check of the weights against a one-rank run. The guide
// quotes the regions between "// [name]" and "// [end name]" word for word
// (tests/util/snippets_test.cpp keeps them equal).
//
//   commgrad-run -n 1 getting_started --steps 8 --save ckpt-1                 # one rank
//   commgrad-run -n 4 getting_started --tp 2 --steps 4 --save ckpt-4          # TP=2 x DP=2, half way
//   commgrad-run -n 4 getting_started --tp 1 --resume ckpt-4 --steps 8 --check ckpt-1   # TP=1 x DP=4

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <optional>
#include <string>

namespace {

constexpr int64_t kIn = 8, kHidden = 32, kOut = 4;
constexpr int64_t kSamples = 64, kGlobalBatch = 16;

struct Config {
  int tp = 1;
  int64_t steps = 8;
  std::string save, resume, check;
};

// [model]
// Megatron's MLP: a column-parallel layer splits the hidden features over the
// tensor-parallel ranks, a row-parallel one sums their parts. Given no group,
// the layers take the installed layout's tensor-parallel group. The seeds
// make the full weights the same at every TP size.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(const commgrad::Group& tp = {})
      : fc1(register_module("fc1", commgrad::tp::ColumnParallelLinear(
                                       commgrad::tp::ColumnParallelLinearOptions(kIn, kHidden, tp).seed(1)))),
        fc2(register_module(
            "fc2", commgrad::tp::RowParallelLinear(
                       commgrad::tp::RowParallelLinearOptions(kHidden, kOut, tp).input_is_parallel(true).seed(2)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  commgrad::tp::ColumnParallelLinear fc1;
  commgrad::tp::RowParallelLinear fc2;
};
TORCH_MODULE(Net);
// [end model]

// A regression data set, the same on every rank.
struct Data {
  torch::Tensor x = torch::randn({kSamples, kIn}, torch::Generator(at::detail::createCPUGenerator(7)));
  torch::Tensor y = torch::sin(x.matmul(torch::linspace(-1, 1, kIn* kOut).reshape({kIn, kOut})));
};

std::optional<int> parse(int argc, char** argv, Config& c) {
  namespace cli = commgrad::cli;
  cli::App app("getting_started", "The program of docs/getting-started.md.");
  app.add_option("--tp", c.tp, "tensor-parallel size (divides the world)")->check(cli::positive());
  app.add_option("--steps", c.steps, "train up to this step")->check(cli::positive());
  app.add_option("--save", c.save, "save the training state here after the last step");
  app.add_option("--resume", c.resume, "load the training state from here first");
  app.add_option("--check", c.check, "compare the weights with a checkpoint of a one-rank run (exit 1 if not equal)");
  return cli::parse(app, argc, argv);
}

// [check]
// The one-rank check: every rank gathers the full weights and compares them
// with those a one-rank run of the same steps saved.
bool same_as_one_rank(Net& model, const std::string& one_rank_checkpoint) {
  const auto mine = commgrad::tp::gather_full_state_dict(*model);  // collective over the TP group
  Net reference(commgrad::self_group());                           // TP = 1, on this rank alone
  commgrad::checkpoint::load_model_weights(one_rank_checkpoint, *reference, {}, commgrad::self_group());
  double worst = 0;
  for (const auto& p : reference->named_parameters()) {
    worst = std::max(worst, (mine[p.key()] - p.value()).abs().max().item<double>());
  }
  if (commgrad::rank() == 0) std::cout << "largest difference from one rank: " << worst << std::endl;
  return worst <= 1e-5;
}
// [end check]

int train(const Config& c) {
  // [setup]
  commgrad::init_process_group();             // RANK, WORLD_SIZE, ... from the launcher
  commgrad::initialize_model_parallel(c.tp);  // TP=c.tp, DP=world/c.tp
  Net model;
  commgrad::optim::ZeroOptimizer zero(
      model.ptr(),
      [](std::vector<torch::Tensor> shards) {
        return std::make_unique<torch::optim::AdamW>(shards, torch::optim::AdamWOptions(1e-2));
      },
      commgrad::optim::ZeroOptimizerOptions().stage(2).max_grad_norm(1.0));  // groups from the layout
  // [end setup]
  // [resume]
  int64_t step = 0;
  if (!c.resume.empty()) step = commgrad::checkpoint::load_training_state(c.resume, *model, zero).step;
  // [end resume]
  // [train]
  const Data data;
  commgrad::dp::DistributedSampler sampler(kSamples);  // over the layout's data-parallel group
  const int64_t batch = kGlobalBatch / sampler.num_replicas();
  const int64_t steps_per_epoch = sampler.num_samples() / batch;
  for (; step < c.steps; ++step) {
    sampler.set_epoch(step / steps_per_epoch);
    const auto mine = torch::tensor(sampler.indices()).narrow(0, step % steps_per_epoch * batch, batch);
    zero.zero_grad();
    const auto loss = torch::mse_loss(model->forward(data.x.index({mine})), data.y.index({mine}));
    loss.backward();  // reduce-scatters the gradients over the data-parallel group
    zero.step();      // clips by the global norm, steps this rank's shard, all-gathers
  }
  // [end train]
  // [save]
  if (!c.save.empty()) commgrad::checkpoint::save_training_state(c.save, step, *model, zero);
  // [end save]
  const bool ok = c.check.empty() || same_as_one_rank(model, c.check);
  commgrad::destroy_model_parallel();
  commgrad::destroy_process_group();
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  if (const auto code = parse(argc, argv, c)) return *code;
  try {
    return train(c);
  } catch (const c10::Error& e) {
    std::cerr << "getting_started: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
