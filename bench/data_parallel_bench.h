#pragma once
// What the data-parallel benchmarks (ddp_bench, zero_bench) share: their
// options, the model (a stack of width x width Linear + ReLU), the clock and
// percentiles.

#include "cli/cli.h"

#include <commgrad/fsdp/fully_shard.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
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

/// Parses `--layers N --width N --batch N --steps N --bucket-cap-mb MB` into
/// `c` (its values are the defaults), and the options `more` adds (a
/// program's own); the exit code when the program ends here (--help, or a
/// bad command line, named on stderr with exit code 2).
inline std::optional<int> parse_config(const std::string& program, const std::string& description, int argc,
                                       char** argv, DataParallelConfig& c,
                                       const std::function<void(cli::App&)>& more = nullptr) {
  cli::App app(program, description);
  app.add_option("--layers", c.layers, "Linear + ReLU layers of the model")->check(cli::positive());
  app.add_option("--width", c.width, "width of each layer")->check(cli::positive());
  app.add_option("--batch", c.batch, "samples per rank and step")->check(cli::positive());
  app.add_option("--steps", c.steps, "measured steps (after " + std::to_string(c.warmup) + " warm-up steps)")
      ->check(cli::positive());
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb, "gradient bucket size (MiB)")->check(cli::number(0, false));
  if (more) more(app);
  return cli::parse(app, argc, argv);
}

struct DeepMlpImpl : torch::nn::Module {
  explicit DeepMlpImpl(const DataParallelConfig& c) {
    for (int i = 0; i < c.layers; ++i) {
      layers.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(c.width, c.width)));
    }
  }
  // Each layer through fsdp::call (a plain forward when it is not a unit).
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) {
      x = torch::relu(commgrad::fsdp::call(layer, x));
      if (probe) {
        probe();                                                                             // forward, after the layer
        if (x.requires_grad()) x.register_hook([p = probe](const torch::Tensor&) { p(); });  // backward, before it
      }
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
  /// When set, called after each layer's forward and before its backward
  /// (zero_bench samples the bytes a sharded model holds mid-step).
  std::function<void()> probe;
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
