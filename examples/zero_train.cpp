// Data-parallel training with a sharded optimizer: commgrad::optim::ZeroOptimizer.
//
// Every rank builds the same MLP (layer sizes chosen so that no bucket splits
// evenly over the ranks), trains on its shard of each batch of a synthetic
// regression problem with gradient accumulation and global-norm clipping,
// and keeps optimizer state for 1/N of the parameters only. In the same job
// each rank also trains the model with DistributedDataParallel and the same
// optimizer (the state on every rank) and compares: the program exits
// non-zero when the two differ. On shm (the transport on one host) they
// agree bit for bit; elsewhere within float32 rounding.
//
//   commgrad-run -n 4 zero_train [--stage 1|2] [--optimizer adam|adamw|sgd] [--epochs 3]
//                                [--accumulate 2] [--max-grad-norm 0.5] [--bucket-cap-mb 0.01]
//
//   [0] world: 4 ranks, backend shm; ZeRO-2 with adam, 2 buckets
//   [0] epoch 1/3: loss 0.513651
//   [0] optimizer state per rank: 7344 bytes (DDP: 29344, 8.0 per parameter / 4 ranks: 7336)
//   [0] max |zero - ddp| = 0 (bit for bit on shm): ok

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

namespace {

constexpr int64_t kSamples = 384;
constexpr int64_t kBatch = 24;  // divisible by 1, 2, 3, 4, 6 and 8 ranks
constexpr int64_t kIn = 9;
constexpr int64_t kOut = 3;
constexpr double kTolerance = 1e-5;

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, 61));
    fc2 = register_module("fc2", torch::nn::Linear(61, 47));
    fc3 = register_module("fc3", torch::nn::Linear(47, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

struct Config {
  int stage = 2;
  std::string optimizer = "adam";
  int epochs = 3;
  int accumulate = 2;  // microbatches per optimizer step
  double max_grad_norm = 0.5;
  double bucket_cap_mb = 0.01;
};

struct Dataset {
  torch::Tensor x, y;
};

// y = sin(x A) + 0.1 noise, identical on every rank.
Dataset make_dataset() {
  torch::manual_seed(2024);
  auto x = torch::randn({kSamples, kIn});
  auto a = torch::randn({kIn, kOut});
  return Dataset{x, torch::sin(x.mm(a)) + 0.1 * torch::randn({kSamples, kOut})};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<torch::Tensor> params) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(3e-3));
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-3).weight_decay(0.05));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.02).momentum(0.9));
}

// One epoch of the loop every data-parallel trainer writes: `accumulate`
// microbatches per step, all but the last under no_sync(). `step` clips and
// steps. Returns the mean loss of this rank's microbatches.
template <class NoSync, class Step>
double train_epoch(Mlp& model, const Dataset& data, const Config& c, int rank, int n, NoSync&& no_sync, Step&& step) {
  double total = 0;
  int count = 0;
  const int64_t micro = kBatch / c.accumulate;
  for (int64_t start = 0; start < kSamples; start += kBatch) {
    for (int mb = 0; mb < c.accumulate; ++mb) {
      auto x = data.x.narrow(0, start + mb * micro, micro).chunk(n, 0)[rank];
      auto y = data.y.narrow(0, start + mb * micro, micro).chunk(n, 0)[rank];
      auto loss = torch::mse_loss(model->forward(x), y) / c.accumulate;
      if (mb + 1 < c.accumulate) {
        auto guard = no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
      total += loss.item<double>() * c.accumulate;
      ++count;
    }
    step();
  }
  return total / count;
}

// The options of the command line into `c`; the exit code when the program
// ends here (--help, or a bad command line, named on stderr with exit code 2).
std::optional<int> parse(int argc, char** argv, Config& c) {
  namespace cli = commgrad::cli;
  cli::App app("zero_train",
               "Data-parallel training with the sharded optimizer (ZeRO-1/2), checked against\n"
               "DistributedDataParallel with the same optimizer (exit 1 when they differ).\n"
               "  commgrad-run -n 4 zero_train");
  app.add_option("--stage", c.stage, "ZeRO stage: 1 (optimizer state sharded) or 2 (and gradients)")
      ->check(cli::integer(1, 2));
  app.add_option("--optimizer", c.optimizer, "adam, adamw or sgd")->check(cli::one_of({"adam", "adamw", "sgd"}));
  app.add_option("--epochs", c.epochs, "epochs to train")->check(cli::positive());
  app.add_option("--accumulate", c.accumulate, "microbatches per step (divides the batch of 24)")
      ->check(cli::positive());
  app.add_option("--max-grad-norm", c.max_grad_norm, "clip the global gradient norm to this (0: do not)")
      ->check(cli::number(0, true));
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb, "gradient bucket size (MiB)")->check(cli::number(0, false));
  return cli::parse(app, argc, argv, [&c] {
    if (kBatch % c.accumulate != 0) throw cli::usage_error("--accumulate must divide the batch of 24");
  });
}

// ZeRO: each rank starts from its own seed; construction broadcasts rank 0's.
// Returns the optimizer state this rank holds, in bytes.
int64_t train_with_zero(Mlp& model, const Config& c, const Dataset& data, int rank, int n,
                        const commgrad::dp::DistributedDataParallelOptions& buckets) {
  commgrad::optim::ZeroOptimizer zero(
      model, [&](std::vector<torch::Tensor> shards) { return make_optimizer(c.optimizer, shards); },
      commgrad::optim::ZeroOptimizerOptions(buckets).stage(c.stage).max_grad_norm(c.max_grad_norm));
  if (rank == 0) {
    std::cout << commgrad::build_info().to_string() << "\n";
    std::cout << "world: " << n << " ranks, backend " << commgrad::world().backend_name() << "; ZeRO-" << c.stage
              << " with " << c.optimizer << ", " << zero.shards().size() << " buckets" << std::endl;
  }
  for (int epoch = 1; epoch <= c.epochs; ++epoch) {
    const double local = train_epoch(
        model, data, c, rank, n, [&] { return zero.no_sync(); },
        [&] {
          zero.step();
          zero.zero_grad();
        });
    const auto loss = commgrad::ops::all_reduce(torch::full({1}, local, torch::kDouble));
    if (rank == 0) {
      std::printf("epoch %d/%d: loss %.6f\n", epoch, c.epochs, loss.item<double>() / n);
      std::fflush(stdout);
    }
  }
  return zero.state_bytes();
}

// The same training with DDP and an unsharded optimizer, from rank 0's
// start; prints the optimizer state per rank of both.
void train_with_ddp(Mlp& reference, const Config& c, const Dataset& data, int rank, int n,
                    const commgrad::dp::DistributedDataParallelOptions& buckets, int64_t zero_state) {
  commgrad::dp::DistributedDataParallel ddp(reference, buckets);
  auto opt = make_optimizer(c.optimizer, reference->parameters());
  for (int epoch = 1; epoch <= c.epochs; ++epoch) {
    train_epoch(
        reference, data, c, rank, n, [&] { return ddp.no_sync(); },
        [&] {
          if (c.max_grad_norm > 0) commgrad::optim::clip_grad_norm_(reference->parameters(), c.max_grad_norm);
          opt->step();
          opt->zero_grad();
        });
  }
  int64_t params = 0, ddp_state = 0;
  for (const auto& p : reference->parameters()) params += p.numel();
  for (const auto& p : reference->parameters()) {
    if (auto s = commgrad::optim::get_param_state(*opt, p)) {
      for (const auto& t : s->tensors) ddp_state += t.second.numel() * static_cast<int64_t>(t.second.element_size());
    }
  }
  if (rank == 0) {
    std::printf("optimizer state per rank: %lld bytes (DDP: %lld, %.1f per parameter / %d ranks: %.0f)\n",
                static_cast<long long>(zero_state), static_cast<long long>(ddp_state),
                static_cast<double>(ddp_state) / params, n, static_cast<double>(ddp_state) / n);
  }
}

// ZeRO's parameters against DDP's: bit for bit on shm or two ranks (the same
// sums in the same order), else within kTolerance.
bool same_parameters(Mlp& model, Mlp& reference, int rank, int n) {
  double worst = 0;
  auto want = reference->named_parameters();
  for (const auto& p : model->named_parameters()) {
    worst = std::max(worst, (p.value() - want[p.key()]).abs().max().item<double>());
  }
  const bool exact = commgrad::world().backend_name() == "shm" || n <= 2;
  const bool ok = exact ? worst == 0 : worst <= kTolerance;
  if (rank == 0 || !ok) {
    if (exact) {
      std::printf("max |zero - ddp| = %.3g (bit for bit on %s): %s\n", worst, commgrad::world().backend_name().c_str(),
                  ok ? "ok" : "MISMATCH");
    } else {
      std::printf("max |zero - ddp| = %.3g (tolerance %.0e): %s\n", worst, kTolerance, ok ? "ok" : "MISMATCH");
    }
    std::fflush(stdout);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config c;
    if (const auto code = parse(argc, argv, c)) return *code;
    commgrad::init_process_group();
    const int rank = commgrad::rank();
    const int n = commgrad::world_size();
    if ((kBatch / c.accumulate) % n != 0) {
      throw std::invalid_argument("each microbatch of " + std::to_string(kBatch / c.accumulate) +
                                  " samples must divide evenly over the ranks");
    }
    const auto data = make_dataset();
    const auto buckets = commgrad::dp::DistributedDataParallelOptions()
                             .bucket_cap_mb(c.bucket_cap_mb)
                             .first_bucket_cap_mb(std::min(c.bucket_cap_mb, 1.0));
    torch::manual_seed(1234 + rank);
    Mlp model;
    const int64_t zero_state = train_with_zero(model, c, data, rank, n, buckets);
    torch::manual_seed(1234);
    Mlp reference;
    train_with_ddp(reference, c, data, rank, n, buckets, zero_state);
    const bool ok = same_parameters(model, reference, rank, n);
    commgrad::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "zero_train: " << e.what() << "\n";
    return 1;
  }
}
