// ParallelMLP step time: tensor parallelism over ranks against one rank
// with the same number of threads.
//
// One step is forward + backward of tp::ParallelMLP (hidden -> ffn -> hidden,
// exact GELU, biases) on [tokens, hidden] float32 input:
//
//   commgrad-run -n 2 tp_mlp_bench            TP = 2, one intra-op thread per rank
//   tp_mlp_bench --threads 2                  TP = 1 (no launcher), two intra-op threads
//
// Options: --hidden 1024 --ffn 4096 --tokens 512 --steps 20 --warmup 3
//          --threads N (intra-op threads per rank; default 1 under a
//          launcher, 2 alone).
//
// Rank 0 prints the median and p10/p90 of the step time and, for TP > 1,
// where it goes: "local" is the same step on this rank's shard sizes without
// any communication (the layer built on a single-rank group with ffn/tp),
// "comm (exposed)" = step - local, and "all-reduce" is the bare all-reduce of
// one [tokens, hidden] activation (the step runs one forward and one in
// backward). Every measured step starts after a barrier, and the variants
// are interleaved round by round so that noise hits them alike.

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace tp = commgrad::tp;

namespace {

struct Config {
  int64_t hidden = 1024;
  int64_t ffn = 4096;
  int64_t tokens = 512;
  int steps = 20;
  int warmup = 3;
  int threads = 0;  // 0: 1 under a launcher, 2 alone
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Stats {
  double p10, p50, p90;
};

Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)]; };
  return {at(0.1), at(0.5), at(0.9)};
}

// The options of the command line into `c`; the exit code when the program
// ends here (--help, or a bad command line, named on stderr with exit code 2).
std::optional<int> parse(int argc, char** argv, Config& c) {
  namespace cli = commgrad::cli;
  cli::App app("tp_mlp_bench",
               "ParallelMLP step time at TP = n (one rank per process) against TP = 1 with n threads.\n"
               "  commgrad-run -n 2 tp_mlp_bench      tp_mlp_bench --threads 2");
  app.add_option("--hidden", c.hidden, "model width")->check(cli::positive<int64_t>());
  app.add_option("--ffn", c.ffn, "inner width of the MLP")->check(cli::positive<int64_t>());
  app.add_option("--tokens", c.tokens, "rows of the input")->check(cli::positive<int64_t>());
  app.add_option("--steps", c.steps, "measured steps")->check(cli::positive());
  app.add_option("--warmup", c.warmup, "untimed steps first")->check(cli::non_negative());
  app.add_option("--threads", c.threads, "intra-op threads per rank (0: 1 under a launcher, 2 alone)")
      ->check(cli::non_negative());
  return cli::parse(app, argc, argv);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  if (const auto code = parse(argc, argv, c)) return *code;
  auto world = commgrad::init_process_group();
  const int n = world.size();
  const int threads = c.threads > 0 ? c.threads : (n > 1 || commgrad::launch_environment().world_size > 1 ? 1 : 2);
  at::set_num_threads(threads);
  const int blas_threads = commgrad::set_blas_threads(threads);
  const bool speaker = world.rank() == 0;

  auto state = commgrad::initialize_model_parallel(n);
  const auto& g = state.tensor_parallel_group();
  tp::ParallelMLP mlp(tp::ParallelMLPOptions(c.hidden, c.ffn, g).seed(1));
  // The same shard sizes without communication.
  tp::ParallelMLP local(tp::ParallelMLPOptions(c.hidden, c.ffn / n, commgrad::self_group()).seed(1));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const auto x = at::randn({c.tokens, c.hidden}, gen).requires_grad_(true);
  const auto activation = at::randn({c.tokens, c.hidden}, gen);

  auto step = [&](tp::ParallelMLP& m) {
    m->zero_grad();
    x.mutable_grad() = at::Tensor();
    m->forward(x).sum().backward();
  };
  struct Variant {
    const char* name;
    std::function<void()> run;
    std::vector<double> times;
  };
  std::vector<Variant> variants;
  variants.push_back({"step", [&] { step(mlp); }, {}});
  if (n > 1) {
    variants.push_back({"local", [&] { step(local); }, {}});
    variants.push_back({"all-reduce", [&] { commgrad::ops::raw::all_reduce(activation, {}, g).wait(); }, {}});
  }

  for (int round = 0; round < c.warmup + c.steps; ++round) {
    for (auto& v : variants) {
      commgrad::ops::barrier(world);
      const double t0 = now_ms();
      v.run();
      const double t1 = now_ms();
      if (round >= c.warmup) v.times.push_back(t1 - t0);
    }
  }

  // Rank 0 reports the slowest rank's view: take each variant's per-step max over ranks.
  for (auto& v : variants) {
    auto t = at::tensor(v.times, at::kDouble);
    t = commgrad::ops::raw::all_reduce(t, commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kMax), world).wait();
    v.times.assign(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  }
  if (speaker) {
    std::printf(
        "# tp_mlp_bench: ParallelMLP hidden %ld ffn %ld tokens %ld float32, TP=%d, %d intra-op thread%s per rank, "
        "%d steps (median of per-step max over ranks)\n",
        static_cast<long>(c.hidden), static_cast<long>(c.ffn), static_cast<long>(c.tokens), n, threads,
        threads > 1 ? "s" : "", c.steps);
    std::printf("# BLAS: %s, %d BLAS thread%s per rank\n", commgrad::active_blas().c_str(), blas_threads,
                blas_threads == 1 ? "" : "s");
    std::printf("# %-16s %10s %10s %10s\n", "variant", "p10 (ms)", "p50 (ms)", "p90 (ms)");
    for (const auto& v : variants) {
      const auto s = stats(v.times);
      std::printf("  %-16s %10.2f %10.2f %10.2f\n", v.name, s.p10, s.p50, s.p90);
    }
    if (n > 1) {
      const double step_ms = stats(variants[0].times).p50;
      const double local_ms = stats(variants[1].times).p50;
      const double ar_ms = stats(variants[2].times).p50;
      std::printf(
          "# comm (exposed) = step - local = %.2f ms (%.0f%% of the step); 2 bare all-reduces = %.2f ms (%.0f%%)\n",
          step_ms - local_ms, 100.0 * (step_ms - local_ms) / step_ms, 2 * ar_ms, 100.0 * 2 * ar_ms / step_ms);
    }
  }
  commgrad::destroy_model_parallel();
  commgrad::destroy_process_group();
  return 0;
}
