// ZeRO memory and step time: DistributedDataParallel + Adam against
// ZeroOptimizer stage 1 and 2 (and stage 2 with bfloat16 parameters and
// float32 master weights), on one model, in one run.
//
// Memory. Per rank: bytes of parameters, of gradients kept between steps and
// of optimizer state, against the ZeRO paper's formulas (arXiv 1910.02054;
// Psi parameters, N ranks; Adam keeps two float32 moments):
//   float32   DDP 4+4+8 Psi,   ZeRO-1 4+4+8/N Psi,   ZeRO-2 4+(4+8)/N Psi
//   bf16 + float32 masters     ZeRO-2 2+(2+12)/N Psi  (12: master, m, v)
// and the growth of the process's peak resident set (VmHWM, reset through
// /proc/self/clear_refs) while the variant is built and takes two steps,
// which also counts the transient gradients of backward.
//
// Time. Every round runs one step of each variant (barrier first), so that
// machine noise hits them alike; rank 0 reports median and p10/p90.
//
//   commgrad-run -n 4 zero_bench [--layers 8] [--width 512] [--batch 32] [--steps 15] [--bucket-cap-mb 4]

#include "data_parallel_bench.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

using commgrad::bench::DataParallelConfig;
using commgrad::bench::DeepMlp;
using commgrad::bench::now_ms;
using commgrad::bench::percentile;

// VmHWM or VmRSS of this process in bytes (0 where /proc lacks it).
int64_t proc_status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::atoll(line.c_str() + key.size() + 1) * 1024;
  }
  return 0;
}
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

struct Variant {
  std::string name;
  int stage = 0;  // 0: DDP
  bool bf16 = false;
  DeepMlp model{nullptr};
  std::unique_ptr<commgrad::dp::DistributedDataParallel> ddp;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<commgrad::optim::ZeroOptimizer> zero;
  std::vector<double> times;
};

std::unique_ptr<torch::optim::Optimizer> adam(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
}

std::unique_ptr<Variant> make_variant(const std::string& name, int stage, bool bf16, const DataParallelConfig& c) {
  auto v = std::make_unique<Variant>();
  v->name = name;
  v->stage = stage;
  v->bf16 = bf16;
  torch::manual_seed(0);
  v->model = DeepMlp(c);
  if (bf16) v->model->to(torch::kBFloat16);
  const auto buckets = commgrad::dp::DistributedDataParallelOptions().bucket_cap_mb(c.bucket_cap_mb).first_bucket_cap_mb(
      std::min(1.0, c.bucket_cap_mb));
  if (stage == 0) {
    v->ddp = std::make_unique<commgrad::dp::DistributedDataParallel>(v->model, buckets);
    v->opt = adam(v->model->parameters());
  } else {
    v->zero = std::make_unique<commgrad::optim::ZeroOptimizer>(
        v->model, adam, commgrad::optim::ZeroOptimizerOptions(buckets).stage(stage));
  }
  return v;
}

double step(Variant& v, const torch::Tensor& x, const torch::Tensor& y) {
  commgrad::ops::barrier();
  const double start = now_ms();
  auto in = v.bf16 ? x.to(torch::kBFloat16) : x;
  auto loss = (v.model->forward(in).to(torch::kFloat) - y).pow(2).mean();
  loss.backward();
  if (v.zero) {
    v.zero->step();
    v.zero->zero_grad();
  } else {
    v.opt->step();
    v.opt->zero_grad();
  }
  return now_ms() - start;
}

struct Memory {
  int64_t params = 0, grads = 0, state = 0, peak = 0;
};

Memory measure(Variant& v) {
  Memory m;
  for (const auto& p : v.model->parameters()) m.params += p.numel() * static_cast<int64_t>(p.element_size());
  if (v.zero) {
    m.grads = v.zero->gradient_bytes();
    m.state = v.zero->state_bytes();
  } else {
    for (const auto& p : v.model->parameters()) {
      if (p.grad().defined()) m.grads += p.grad().numel() * static_cast<int64_t>(p.grad().element_size());
      if (auto s = commgrad::optim::get_param_state(*v.opt, p)) {
        for (const auto& t : s->tensors) m.state += t.second.numel() * static_cast<int64_t>(t.second.element_size());
      }
    }
  }
  return m;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024 * 1024); }

}  // namespace

int main(int argc, char** argv) {
  DataParallelConfig c;
  c.batch = 32;
  c.steps = 15;
  c.bucket_cap_mb = 4;
  if (const auto code = commgrad::bench::parse_config(
          "zero_bench",
          "ZeRO-1/2 against DistributedDataParallel + Adam: memory per rank against the ZeRO formulas,\n"
          "and step time.\n"
          "  commgrad-run -n 4 zero_bench",
          argc, argv, c)) {
    return *code;
  }
  try {
    commgrad::init_process_group();
    const bool speaker = commgrad::rank() == 0;
    const int n = commgrad::world_size();
    torch::manual_seed(1 + commgrad::rank());
    const auto x = torch::randn({c.batch, c.width});
    const auto y = torch::randn({c.batch, c.width});
    struct Spec {
      const char* name;
      int stage;
      bool bf16;
    };
    const std::vector<Spec> specs = {{"DDP + Adam", 0, false},
                                     {"ZeRO-1 + Adam", 1, false},
                                     {"ZeRO-2 + Adam", 2, false},
                                     {"ZeRO-2 + Adam, bf16 params, fp32 masters", 2, true}};
    const double psi = static_cast<double>(c.layers) * (c.width * c.width + c.width);
    auto formula = [&](const Spec& s) {
      if (s.bf16) return 2 + 14.0 / n;
      return s.stage == 0 ? 16.0 : s.stage == 1 ? 8 + 8.0 / n : 4 + 12.0 / n;
    };
    auto state_formula = [&](const Spec& s) { return (s.bf16 ? 12.0 : 8.0) * psi / (s.stage == 0 ? 1 : n); };

    // Memory: one variant at a time.
    if (speaker) {
      std::printf("zero_bench: %d ranks (%s), %d x Linear(%d, %d): Psi = %.0f parameters (%.1f MiB in fp32), batch %d "
                  "per rank, %d steps after %d warm-up, buckets of %.1f MiB\n\n",
                  n, commgrad::world().backend_name().c_str(), c.layers, c.width, c.width, psi, mib(4 * psi), c.batch,
                  c.steps, c.warmup, c.bucket_cap_mb);
      std::printf("Memory per rank (rank 0), MiB:\n"
                  "| variant | params | grads kept | optimizer state | state / formula | total | formula "
                  "(bytes/param) | peak RSS growth |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    for (const auto& s : specs) {
      const int64_t before = proc_status_bytes("VmRSS");
      reset_peak_rss();
      auto v = make_variant(s.name, s.stage, s.bf16, c);
      for (int k = 0; k < 2; ++k) step(*v, x, y);
      Memory m = measure(*v);
      m.peak = proc_status_bytes("VmHWM") - before;
      if (speaker) {
        std::printf("| %s | %.2f | %.2f | %.2f | %.3f | %.2f | %.2f (%.2f) | %.1f |\n", s.name, mib(m.params),
                    mib(m.grads), mib(m.state), m.state / state_formula(s), mib(m.params + m.grads + m.state),
                    mib(static_cast<int64_t>(formula(s) * psi)), formula(s), mib(m.peak));
      }
    }

    // Time: all variants, interleaved.
    std::vector<std::unique_ptr<Variant>> variants;
    for (const auto& s : specs) variants.push_back(make_variant(s.name, s.stage, s.bf16, c));
    for (int round = 0; round < c.warmup + c.steps; ++round) {
      for (auto& v : variants) {
        const double t = step(*v, x, y);
        if (round >= c.warmup) v->times.push_back(t);
      }
    }
    if (speaker) {
      std::printf("\nStep time (rank 0), ms:\n| variant | p50 | p10 | p90 | p50 / DDP |\n|---|---:|---:|---:|---:|\n");
      const double ddp = percentile(variants[0]->times, 0.5);
      for (const auto& v : variants) {
        const double p50 = percentile(v->times, 0.5);
        std::printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", v->name.c_str(), p50, percentile(v->times, 0.1),
                    percentile(v->times, 0.9), p50 / ddp);
      }
    }
    commgrad::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
