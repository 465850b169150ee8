#pragma once
// What the data-parallel benchmarks (ddp_bench, zero_bench) share: their
// options, the model (a stack of width x width Linear + ReLU), the clock and
// percentiles.

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

namespace commgrad::bench {

struct DataParallelConfig {
  int layers = 8;
  int width = 512;
  int batch = 64;  // per rank
  int steps = 20;
  int warmup = 3;
  double bucket_cap_mb = 2;
};

/// Parses `--layers N --width N --batch N --steps N --bucket-cap-mb MB` into `c`;
/// false on anything else.
inline bool parse_config(int argc, char** argv, DataParallelConfig& c) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const double value = std::atof(argv[i + 1]);
    if (flag == "--layers") c.layers = static_cast<int>(value);
    else if (flag == "--width") c.width = static_cast<int>(value);
    else if (flag == "--batch") c.batch = static_cast<int>(value);
    else if (flag == "--steps") c.steps = static_cast<int>(value);
    else if (flag == "--bucket-cap-mb") c.bucket_cap_mb = value;
    else return false;
  }
  return argc % 2 == 1;
}

struct DeepMlpImpl : torch::nn::Module {
  explicit DeepMlpImpl(const DataParallelConfig& c) {
    for (int i = 0; i < c.layers; ++i) {
      layers.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(c.width, c.width)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) x = torch::relu(layer(x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(DeepMlp);

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The q-quantile (0..1) of `v`, nearest rank.
inline double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

}  // namespace commgrad::bench
