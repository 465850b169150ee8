// A pipeline job for the process tests (run under commgrad-run):
//   pipeline_job train <schedule> <microbatches> [stages per rank]
//       trains 2 steps of a model of ranks x v stages (Linear + tanh) over
//       the world and compares the loss and every gradient with the whole
//       model on each rank; prints "ok" or exits 1
//   pipeline_job kill <schedule> <microbatches>
//       rank 1 kills itself (SIGKILL) in its forward of microbatch 1; the
//       others must fail within the timeout, naming the stage and microbatch

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <string>

namespace {

constexpr int64_t kWidth = 4;

torch::nn::Linear block(int stage) {
  torch::nn::Linear fc(kWidth, kWidth);
  fc->to(torch::kDouble);
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + stage);
  fc->weight.copy_(at::randn({kWidth, kWidth}, gen).to(torch::kDouble) * 0.5);
  fc->bias.copy_(at::randn({kWidth}, gen).to(torch::kDouble) * 0.1);
  return fc;
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: pipeline_job train|kill <schedule> <microbatches> [stages per rank]\n";
    return 2;
  }
  const std::string mode = argv[1];
  const std::string schedule = argv[2];
  const int m = std::stoi(argv[3]);
  const int v = argc > 4 ? std::stoi(argv[4]) : 1;
  try {
    // kill: the survivors must find the dead rank themselves, within 5 s,
    // not be stopped by the launcher's SIGTERM first.
    if (mode == "kill") std::signal(SIGTERM, SIG_IGN);
    commgrad::init_process_group(commgrad::InitOptions().timeout(mode == "kill" ? std::chrono::milliseconds(5000)
                                                                                : std::chrono::milliseconds(0)));
    const int rank = commgrad::rank();
    const int p = commgrad::world_size();
    const auto x = at::randn({2 * m, kWidth}, at::make_generator<at::CPUGeneratorImpl>(1)).to(torch::kDouble);
    const auto y = at::randn({2 * m, kWidth}, at::make_generator<at::CPUGeneratorImpl>(2)).to(torch::kDouble);
    std::vector<torch::nn::Linear> mine;
    std::vector<commgrad::pp::StageFunction> stages;
    for (int c = 0; c < v; ++c) {
      const int stage = c * p + rank;
      mine.push_back(block(stage));
      auto fc = mine.back();
      stages.push_back([fc, stage, mode](const at::Tensor& in) mutable {
        static int calls = 0;
        if (mode == "kill" && stage == 1 && ++calls == 2) std::raise(SIGKILL);  // in the forward of microbatch 1
        return torch::tanh(fc->forward(in));
      });
    }
    commgrad::pp::Pipeline pipe(stages, mse, commgrad::pp::PipelineOptions(m).schedule(schedule).stages_per_rank(v));
    bool ok = true;
    for (int step = 1; step <= 2; ++step) {
      const auto result = pipe.step(x, y);
      // The whole model on this rank, for comparison.
      std::vector<torch::nn::Linear> whole;
      for (int s = 0; s < p * v; ++s) whole.push_back(block(s));
      auto h = x;
      for (auto& fc : whole) h = torch::tanh(fc->forward(h));
      auto loss = mse(h, y);
      loss.backward();
      ok = ok && std::abs(result.loss - loss.item<double>()) < 1e-12;
      for (int c = 0; c < v; ++c) {
        const auto want = whole[c * p + rank]->weight.grad() * step;
        ok = ok && torch::allclose(mine[c]->weight.grad(), want, 1e-10, 1e-12);
      }
      if (rank == 0) std::printf("step %d: loss %.6f\n", step, result.loss);
    }
    if (rank == 0 || !ok) std::printf("%s\n", ok ? "ok" : "MISMATCH");
    commgrad::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const c10::Error& e) {
    std::cerr << "pipeline_job: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "pipeline_job: " << e.what() << "\n";
    return 1;
  }
}
