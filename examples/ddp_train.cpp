// Data-parallel training with commgrad::DistributedDataParallel.
//
// Every rank builds the same small MLP (from a different seed: DDP
// broadcasts rank 0's parameters at construction), trains on its shard of
// each batch of a synthetic regression problem, and lets DDP average the
// gradients in buckets during backward. Rank 0 prints one line per epoch.
// At the end each rank also trains the model alone on the full batches and
// compares: the program exits non-zero when its DDP replica differs from
// that single-process run by more than the tolerance (float32 rounding).
//
//   commgrad-run -n 4 ddp_train [--epochs 5] [--bucket-cap-mb 25] [--device cpu|cuda]
//
// With --device cuda the DDP replicas train on each rank's GPU and the
// single-process reference stays on the CPU.
//   [0] world: 4 ranks, backend gloo; 3 gradient buckets
//   [0] epoch 1/5: loss 0.412345
//   ...
//   [0] max |ddp - single process| = 3.1e-08 (tolerance 1e-05): ok

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

constexpr int64_t kSamples = 512;
constexpr int64_t kBatch = 32;  // divisible by 1, 2, 4, 8 and 16 ranks
constexpr int64_t kIn = 8;
constexpr int64_t kOut = 2;
constexpr double kTolerance = 1e-5;

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

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

// One epoch over the data; rank `rank` of `n` uses its rows of each batch.
// Returns the mean loss of this rank's shards.
double train_epoch(Mlp& model, torch::optim::Optimizer& opt, const Dataset& data, int rank, int n,
                   const torch::Device& device = torch::kCPU) {
  double total = 0;
  int batches = 0;
  for (int64_t start = 0; start < kSamples; start += kBatch, ++batches) {
    auto x = data.x.narrow(0, start, kBatch).chunk(n, 0)[rank].to(device);
    auto y = data.y.narrow(0, start, kBatch).chunk(n, 0)[rank].to(device);
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    opt.step();
    total += loss.item<double>();
  }
  return total / batches;
}

torch::optim::SGD make_optimizer(Mlp& model) {
  return torch::optim::SGD(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}
}  // namespace

int main(int argc, char** argv) {
  try {
    int epochs = 5;
    double bucket_cap_mb = 25;
    bool cuda = false;
    namespace cli = commgrad::cli;
    cli::App app("ddp_train",
                 "Data-parallel training with DistributedDataParallel, checked against one process training\n"
                 "on the full batches (exit 1 when they differ).\n"
                 "  commgrad-run -n 4 ddp_train");
    app.add_option("--epochs", epochs, "epochs to train")->check(cli::positive());
    app.add_option("--bucket-cap-mb", bucket_cap_mb, "DDP's gradient bucket size (MiB)")->check(cli::number(0, false));
    cli::add_device_option(app, cuda, "where the replicas train (cuda: this rank's GPU)");
    if (const auto code = cli::parse(app, argc, argv)) return *code;

    commgrad::init_process_group();
    const int rank = commgrad::rank();
    const int n = commgrad::world_size();
    if (kBatch % n != 0) throw std::invalid_argument("the batch of 32 must divide evenly over the ranks");
    const auto data = make_dataset();
    if (cuda && commgrad::cuda_device_count() == 0) throw std::invalid_argument("--device cuda, but no CUDA device");
    const torch::Device device = cuda ? commgrad::device() : torch::Device(torch::kCPU);

    // DDP: each rank starts from its own seed; construction broadcasts rank 0's.
    torch::manual_seed(1234 + rank);
    Mlp model;
    model->to(device);
    commgrad::DistributedDataParallel ddp(model, commgrad::DistributedDataParallelOptions()
                                                     .bucket_cap_mb(bucket_cap_mb)
                                                     .first_bucket_cap_mb(std::min(bucket_cap_mb, 1.0)));
    auto opt = make_optimizer(model);
    if (rank == 0) {
      std::cout << commgrad::build_info().to_string() << "\n";
      std::cout << "world: " << n << " ranks, backend " << commgrad::world().backend_name()
                << (cuda ? ", CUDA tensors over " + commgrad::world().cuda_backend_name() : std::string()) << "; "
                << ddp.buckets().size() << " gradient bucket(s)" << std::endl;
    }
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      const double local = train_epoch(model, opt, data, rank, n, device);
      const auto loss = commgrad::ops::all_reduce(torch::full({1}, local, torch::kDouble));
      if (rank == 0) {
        std::printf("epoch %d/%d: loss %.6f\n", epoch, epochs, loss.item<double>() / n);
        std::fflush(stdout);
      }
    }

    // The same training in one process, on the full batches, from rank 0's start.
    torch::manual_seed(1234);
    Mlp single;
    auto single_opt = make_optimizer(single);
    for (int epoch = 1; epoch <= epochs; ++epoch) train_epoch(single, single_opt, data, 0, 1);
    double worst = 0;
    auto want = single->named_parameters();
    for (const auto& p : model->named_parameters()) {
      worst = std::max(worst, (p.value().cpu() - want[p.key()]).abs().max().item<double>());
    }
    const bool ok = worst <= kTolerance;
    if (rank == 0 || !ok) {
      std::printf("max |ddp - single process| = %.3g (tolerance %.0e): %s\n", worst, kTolerance,
                  ok ? "ok" : "MISMATCH");
      std::fflush(stdout);
    }
    commgrad::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "ddp_train: " << e.what() << "\n";
    return 1;
  }
}
