// The Megatron feed-forward block on N tensor-parallel ranks, checked
// against the same block on one rank.
//
//   commgrad-run -n 4 megatron_ffn
//
// Every rank builds tp::ParallelMLP (ColumnParallelLinear -> GELU ->
// RowParallelLinear, split 4 ways) and its unsplit reference (two
// torch::nn::Linear layers) from one seed, runs forward and backward on the
// same input, and commgrad::check compares the output, the loss, the input
// gradient and every weight and bias with its gradient. Three runs: float32,
// float32 with sequence parallelism (input and output split along the
// sequence), and float64. Rank 0 prints the tables; the program exits
// non-zero when any tensor is outside its tolerance.
//
// With --device cuda the parallel block runs on each rank's GPU (float32 and
// float64; the reference stays on the CPU).

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <iostream>

namespace tp = commgrad::tp;
namespace check = commgrad::check;

namespace {

constexpr int64_t kHidden = 64;
constexpr int64_t kFfn = 256;
constexpr int64_t kSeq = 16;
constexpr int64_t kBatch = 2;
constexpr uint64_t kSeed = 1234;

// The unsplit FFN: what tp::ParallelMLP computes on one rank.
struct ReferenceMLPImpl : torch::nn::Module {
  ReferenceMLPImpl(int64_t hidden, int64_t ffn, uint64_t seed) {
    fc1 = register_module("fc1", torch::nn::Linear(hidden, ffn));
    fc2 = register_module("fc2", torch::nn::Linear(ffn, hidden));
    load(fc1, tp::init_linear(hidden, ffn, true, seed));
    load(fc2, tp::init_linear(ffn, hidden, true, seed + 1));
  }
  static void load(torch::nn::Linear& fc, const tp::LinearWeights& w) {
    torch::NoGradGuard no_grad;
    fc->weight.copy_(w.weight);
    fc->bias.copy_(w.bias);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ReferenceMLP);

bool run(const commgrad::Group& tp_group, bool sequence_parallel, torch::ScalarType dtype, bool speaker,
         const torch::Device& device) {
  tp::ParallelMLP mlp(tp::ParallelMLPOptions(kHidden, kFfn, tp_group).seed(kSeed).sequence_parallel(sequence_parallel));
  ReferenceMLP reference(kHidden, kFfn, kSeed);
  mlp->to(device, dtype);
  reference->to(dtype);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed + 7);
  auto x = at::randn({kSeq, kBatch, kHidden}, gen).to(dtype);

  const auto layout = sequence_parallel ? check::Layout::partitioned(0) : check::Layout::replicated();
  auto options =
      check::GradCheckOptions(tp_group).parallel_device(device).input_layouts({layout}).output_layout(layout).title(
          c10::str("ParallelMLP(hidden=", kHidden, ", ffn=", kFfn, ")", sequence_parallel ? " sequence-parallel" : ""));
  auto result = check::check_gradients(check::subject(mlp), check::subject(reference), {x}, options);
  if (speaker) std::cout << result << std::endl;
  return result.ok();
}

}  // namespace

int main(int argc, char** argv) {
  bool cuda = false;
  commgrad::cli::App app("megatron_ffn",
                         "The Megatron feed-forward block on N tensor-parallel ranks, checked against the same block\n"
                         "on one rank (exit 1 when a tensor is outside its tolerance).\n"
                         "  commgrad-run -n 4 megatron_ffn");
  commgrad::cli::add_device_option(app, cuda, "where the parallel block runs (cuda: this rank's GPU)");
  if (const auto code = commgrad::cli::parse(app, argc, argv)) return *code;
  try {
    commgrad::init_process_group();
    if (cuda && commgrad::cuda_device_count() == 0) throw std::invalid_argument("--device cuda, but no CUDA device");
    const torch::Device device = cuda ? commgrad::device() : torch::Device(torch::kCPU);
    const int n = commgrad::world_size();
    const bool speaker = commgrad::rank() == 0;
    auto state = commgrad::initialize_model_parallel(n);
    if (speaker) {
      std::cout << commgrad::build_info().to_string() << "\n";
      std::cout << "Megatron FFN on " << n << " tensor-parallel rank" << (n > 1 ? "s" : "") << " (" << state.describe()
                << "), input [seq=" << kSeq << ", batch=" << kBatch << ", hidden=" << kHidden << "], ffn=" << kFfn
                << ", seed " << kSeed << "\n"
                << "BLAS: " << commgrad::active_blas() << "\n"
                << "device: " << device
                << (cuda ? ", CUDA tensors over " + state.tensor_parallel_group().cuda_backend_name() : std::string())
                << "\n\n";
    }
    const auto& g = state.tensor_parallel_group();
    bool ok = true;
    ok = run(g, /*sequence_parallel=*/false, torch::kFloat32, speaker, device) && ok;
    ok = run(g, /*sequence_parallel=*/true, torch::kFloat32, speaker, device) && ok;
    ok = run(g, /*sequence_parallel=*/false, torch::kFloat64, speaker, device) && ok;
    commgrad::destroy_model_parallel();
    commgrad::destroy_process_group();
    if (!ok) {
      std::cerr << "megatron_ffn: the parallel FFN does not match the one-rank reference\n";
      return 1;
    }
    if (speaker) std::cout << "megatron_ffn: TP=" << n << " matches TP=1\n";
  } catch (const c10::Error& e) {
    std::cerr << "megatron_ffn: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "megatron_ffn: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
