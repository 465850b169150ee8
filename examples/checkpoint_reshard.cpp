// Save a training run under one tensor x data-parallel layout, resume it
// under others, and check that the loss curve goes on as if nothing happened.
//
//   commgrad-run -n 4 checkpoint_reshard [--save-tp 2] [--load-tp 1,4,2] [--steps 10]
//
// Every rank trains a tp::ParallelMLP with the sharded optimizer (ZeRO-2,
// AdamW, global-norm clipping) on a synthetic regression problem:
//   1. `steps` steps without interruption at TP = save-tp (DP = world / TP);
//   2. steps/2 steps at that layout, then a sharded checkpoint (model, ZeRO
//      state, RNG streams) written by every rank into one directory;
//   3. for each TP size in --load-tp: a fresh model and optimizer at
//      TP = t x DP = world / t, loaded from the checkpoint (resharded), and
//      the remaining steps.
// Rank 0 prints each resumed curve against the continuous one. The program
// exits non-zero when a resumed loss differs: bit for bit at the layout of
// the save, within float32 rounding (relative 1e-5) under another.
//
//   [0] saved step 5 at TP=2 x DP=2 (4 ranks) in /tmp/commgrad-checkpoint-reshard-.../step-00000005
//   [0] TP=1 x DP=4: step 6 loss 0.371435 (continuous 0.371435) ... max relative difference 8.6e-08: ok
//   [0] TP=4 x DP=1: step 6 loss 0.371435 (continuous 0.371435) ... max relative difference 8.6e-08: ok
//   [0] TP=2 x DP=2: step 6 loss 0.371435 (continuous 0.371435) ... max relative difference 0 (bit for bit): ok

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace tp = commgrad::tp;
namespace checkpoint = commgrad::checkpoint;

namespace {

constexpr int64_t kModel = 16;
constexpr int64_t kFfn = 64;
constexpr int64_t kBatch = 16;  // divisible by 1, 2 and 4 data-parallel ranks
constexpr uint64_t kSeed = 42;

struct Config {
  int save_tp = 2;
  std::vector<int> load_tp = {1, 4, 2};
  int steps = 10;
};

// One training run at TP = tp (DP = world / tp) from step `from` to `to`.
struct Run {
  commgrad::ParallelState state;
  tp::ParallelMLP mlp{nullptr};
  std::unique_ptr<commgrad::optim::ZeroOptimizer> zero;

  explicit Run(int tp_size) : state(commgrad::make_model_parallel(tp_size, 1, commgrad::world())) {
    mlp = tp::ParallelMLP(tp::ParallelMLPOptions(kModel, kFfn, state.tensor_parallel_group()).seed(kSeed));
    zero = std::make_unique<commgrad::optim::ZeroOptimizer>(
        mlp,
        [](std::vector<torch::Tensor> shards) {
          return std::make_unique<torch::optim::AdamW>(shards, torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
        },
        commgrad::optim::ZeroOptimizerOptions(commgrad::dp::DistributedDataParallelOptions(state.data_parallel_group())
                                                  .bucket_cap_mb(0.004)
                                                  .first_bucket_cap_mb(0.001))
            .stage(2)
            .max_grad_norm(1.0)
            .tensor_parallel_group(state.tensor_parallel_group()));
  }

  std::string layout() const {
    return "TP=" + std::to_string(state.tensor_parallel_size()) + " x DP=" + std::to_string(state.data_parallel_size());
  }

  // Steps [from, to) of the data every layout shares; the mean loss per step.
  std::vector<double> train(int from, int to) {
    std::vector<double> losses;
    const int dp = state.data_parallel_rank();
    const int dp_size = state.data_parallel_size();
    for (int k = from; k < to; ++k) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + k);
      const auto x = at::randn({kBatch, kModel}, gen);
      const auto y = torch::sin(x.roll(1, 1)) + 0.1 * at::randn({kBatch, kModel}, gen);
      zero->zero_grad();
      auto loss = torch::mse_loss(mlp->forward(x.chunk(dp_size, 0)[dp]), y.chunk(dp_size, 0)[dp]);
      loss.backward();
      zero->step();
      const auto mean = commgrad::ops::raw::all_reduce(loss.detach().reshape({1}),
                                                       commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kAvg),
                                                       state.data_parallel_group())
                            .wait();
      losses.push_back(mean.item<double>());
    }
    return losses;
  }

  std::vector<checkpoint::TensorPiece> save_pieces() {
    auto pieces = checkpoint::module_pieces(*mlp);
    for (auto& p : checkpoint::optimizer_pieces(*zero)) pieces.push_back(std::move(p));
    for (auto& p : checkpoint::rng_pieces(tp::rng_tracker(), state.tensor_parallel_group()))
      pieces.push_back(std::move(p));
    return pieces;
  }

  int64_t load(const std::string& root) {
    auto model = checkpoint::module_pieces(*mlp);
    auto optim = checkpoint::optimizer_load_pieces(*zero);
    auto rng = checkpoint::rng_pieces(tp::rng_tracker(), state.tensor_parallel_group());
    std::vector<checkpoint::TensorPiece> all = model;
    all.insert(all.end(), optim.begin(), optim.end());
    all.insert(all.end(), rng.begin(), rng.end());
    const auto result = checkpoint::load(root, all);
    checkpoint::restore_optimizer(
        *zero,
        std::vector<checkpoint::TensorPiece>(all.begin() + model.size(), all.begin() + model.size() + optim.size()),
        result);
    checkpoint::restore_rng(tp::rng_tracker(), std::vector<checkpoint::TensorPiece>(all.end() - rng.size(), all.end()),
                            result);
    return result.step;
  }
};

// The options of the command line into `c`; the exit code when the program
// ends here (--help, or a bad command line, named on stderr with exit code 2).
std::optional<int> parse(int argc, char** argv, Config& c) {
  namespace cli = commgrad::cli;
  cli::App app("checkpoint_reshard",
               "Save a training run under one TP x DP layout, resume it under others, and check that the\n"
               "loss curve goes on as if nothing happened (exit 1 when a resumed loss differs).\n"
               "  commgrad-run -n 4 checkpoint_reshard");
  app.add_option("--save-tp", c.save_tp, "tensor-parallel size of the run that saves")->check(cli::positive());
  app.add_option("--load-tp", c.load_tp, "tensor-parallel sizes to resume at, comma-separated")
      ->delimiter(',')
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->check(cli::positive())
      ->type_name("N,N,...")
      ->default_str("1,4,2");
  app.add_option("--steps", c.steps, "steps of the continuous run (the checkpoint is saved at half)")
      ->check(cli::integer(2));
  return cli::parse(app, argc, argv);
}

// A fresh directory name, the same on every rank (rank 0 draws it).
std::string scratch_root() {
  auto nonce = torch::full({1}, static_cast<int64_t>(std::random_device{}() & 0x7fffffff), torch::kLong);
  nonce = commgrad::ops::raw::broadcast(nonce, {}, commgrad::world()).wait();
  return (std::filesystem::temp_directory_path() /
          ("commgrad-checkpoint-reshard-" + std::to_string(nonce.item<int64_t>())))
      .string();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config c;
    if (const auto code = parse(argc, argv, c)) return *code;
    commgrad::init_process_group();
    const int rank = commgrad::rank();
    const int n = commgrad::world_size();
    for (int t : c.load_tp) {
      if (t < 1 || n % t != 0)
        throw std::invalid_argument("TP size " + std::to_string(t) + " does not divide " + std::to_string(n) +
                                    " ranks");
    }
    if (n % c.save_tp != 0) throw std::invalid_argument("--save-tp does not divide the world");
    const int half = c.steps / 2;
    const std::string root = scratch_root();
    if (rank == 0) std::cout << commgrad::build_info().to_string() << "\n";

    std::vector<double> continuous;
    {
      Run run(c.save_tp);
      continuous = run.train(0, c.steps);
    }
    {
      Run run(c.save_tp);
      run.train(0, half);
      const auto saved = checkpoint::save(root, half, run.save_pieces(), {{"layout", run.layout()}});
      if (rank == 0) {
        std::printf("saved step %d at %s (%d ranks) in %s\n", half, run.layout().c_str(), n, saved.directory.c_str());
      }
    }
    bool ok = true;
    for (int t : c.load_tp) {
      Run run(t);
      const int64_t step = run.load(root);
      const auto resumed = run.train(static_cast<int>(step), c.steps);
      const bool exact = t == c.save_tp;
      double worst = 0;
      std::ostringstream line;
      line << run.layout() << ":";
      for (size_t i = 0; i < resumed.size(); ++i) {
        const double want = continuous[step + i];
        worst = std::max(worst, std::abs(resumed[i] - want) / std::max(1e-12, std::abs(want)));
        if (i == 0) {
          char buf[128];
          std::snprintf(buf, sizeof buf, " step %lld loss %.6f (continuous %.6f) ...", static_cast<long long>(step + 1),
                        resumed[i], want);
          line << buf;
        }
      }
      const bool good = exact ? worst == 0 : worst <= 1e-5;
      ok = ok && good;
      char buf[160];
      std::snprintf(buf, sizeof buf, " max relative difference %.2g%s: %s", worst, exact ? " (bit for bit)" : "",
                    good ? "ok" : "MISMATCH");
      if (rank == 0 || !good) std::cout << line.str() << buf << std::endl;
    }
    commgrad::ops::barrier();
    if (rank == 0) std::filesystem::remove_all(root);
    commgrad::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "checkpoint_reshard: " << e.what() << "\n";
    return 1;
  }
}
