// MoELayer step time at EP = n (the world is the expert-parallel group, one
// intra-op thread per rank), tokens/s, and what the dispatch costs.
//
//   moe_bench                          EP = 1: one rank, every expert
//   commgrad-run -n 2 moe_bench        EP = 2: each rank its own T tokens and E/2 experts
//
// Options: --hidden 256 --ffn 1024 --experts 8 --topk 2 --tokens 512 (per
//          rank) --steps 10 --warmup 2 --dispatcher all_to_all|all_gather
//
// One step is forward + backward of moe::MoELayer (router, dispatch,
// experts, combine) on this rank's [tokens, hidden] float32 input; tokens/s
// counts every rank's tokens. "a2a" is the dispatch's traffic alone: the
// counts all-to-all and the four row all-to-alls of a step (dispatch and
// combine, forward and backward) with the splits of the last step, bare
// (ops::raw). Rows: those this rank sent to other ranks in the last
// dispatch, against the closed form of uniform routing T k (n - 1) / n; bytes
// per step = 4 * rows * hidden * 4 (float32). Every measured step starts
// after a barrier; rank 0 reports the median of the per-step max over ranks.

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

namespace moe = commgrad::moe;

namespace {

struct Config {
  int64_t hidden = 256, ffn = 1024, experts = 8, topk = 2, tokens = 512;
  int steps = 10, warmup = 2;
  std::string dispatcher = "all_to_all";
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::optional<int> parse(int argc, char** argv, Config& c) {
  namespace cli = commgrad::cli;
  cli::App app("moe_bench",
               "MoELayer step time at EP = n (one rank per process, one thread each), tokens/s and the\n"
               "dispatch's share and bytes.\n  moe_bench      commgrad-run -n 2 moe_bench");
  app.add_option("--hidden", c.hidden, "model width")->check(cli::positive<int64_t>());
  app.add_option("--ffn", c.ffn, "inner width of each expert")->check(cli::positive<int64_t>());
  app.add_option("--experts", c.experts, "experts (divisible by the ranks)")->check(cli::positive<int64_t>());
  app.add_option("--topk", c.topk, "experts per token")->check(cli::positive<int64_t>());
  app.add_option("--tokens", c.tokens, "tokens per rank")->check(cli::positive<int64_t>());
  app.add_option("--steps", c.steps, "measured steps")->check(cli::positive());
  app.add_option("--warmup", c.warmup, "untimed steps first")->check(cli::non_negative());
  app.add_option("--dispatcher", c.dispatcher, "all_to_all or all_gather")
      ->check(cli::one_of({"all_to_all", "all_gather"}));
  return cli::parse(app, argc, argv);
}

struct Variant {
  const char* name;
  std::function<void()> run;
  std::vector<double> times;
};

void report(const Config& c, int n, const std::vector<Variant>& variants, int64_t sent_rows) {
  const double step = median(variants[0].times);
  std::printf(
      "# moe_bench: hidden %ld ffn %ld experts %ld top-%ld, %ld tokens per rank, float32, EP=%d (%s), "
      "1 thread per rank, %d steps\n",
      static_cast<long>(c.hidden), static_cast<long>(c.ffn), static_cast<long>(c.experts), static_cast<long>(c.topk),
      static_cast<long>(c.tokens), n, c.dispatcher.c_str(), c.steps);
  std::printf("  step %.2f ms, %.0f tokens/s\n", step, 1000.0 * static_cast<double>(c.tokens * n) / step);
  if (n > 1) {
    const double a2a = median(variants[1].times);
    const double expected = static_cast<double>(c.tokens * c.topk) * (n - 1) / n;
    std::printf("  a2a (bare) %.2f ms = %.0f%% of the step\n", a2a, 100.0 * a2a / step);
    std::printf("  rows sent to other ranks by rank 0: %ld (uniform routing: %.0f); bytes per step %ld\n",
                static_cast<long>(sent_rows), expected, static_cast<long>(4 * sent_rows * c.hidden * 4));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  if (const auto code = parse(argc, argv, c)) return *code;
  auto world = commgrad::init_process_group();
  const int n = world.size();
  at::set_num_threads(1);
  commgrad::set_blas_threads(1);
  moe::MoELayer layer(
      moe::MoELayerOptions(c.hidden, c.ffn, c.experts, c.topk, world)
          .routing(moe::RoutingOptions().aux_loss_coeff(1e-2))
          .dispatcher(c.dispatcher == "all_gather" ? moe::DispatcherType::kAllGather : moe::DispatcherType::kAllToAll)
          .seed(1));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2 + world.rank());
  const auto x = at::randn({c.tokens, c.hidden}, gen).requires_grad_(true);

  // The splits of one dispatch of x, for the bare all-to-alls and the rows.
  moe::DispatchPlan plan;
  {
    at::NoGradGuard no_grad;
    const auto r = layer->router(x);
    plan = moe::all_to_all_dispatch(x, r.experts, {}, c.experts, world).plan;
  }
  const int64_t sent_rows = std::accumulate(plan.input_splits.begin(), plan.input_splits.end(), int64_t{0}) -
                            (n > 1 ? plan.input_splits[world.rank()] : plan.input_splits[0]);
  const auto rows_out =
      at::zeros({std::accumulate(plan.input_splits.begin(), plan.input_splits.end(), int64_t{0}), c.hidden});
  const auto counts = at::zeros({c.experts}, at::kLong);
  auto bare_a2a = [&] {
    namespace raw = commgrad::ops::raw;
    const auto fwd = commgrad::ops::AllToAllOptions().input_splits(plan.input_splits).output_splits(plan.output_splits);
    const auto back =
        commgrad::ops::AllToAllOptions().input_splits(plan.output_splits).output_splits(plan.input_splits);
    raw::all_to_all(counts, {}, world).wait();
    for (int i = 0; i < 2; ++i) {
      const auto got = raw::all_to_all(rows_out, fwd, world).wait();
      raw::all_to_all(got, back, world).wait();
    }
  };

  std::vector<Variant> variants;
  variants.push_back({"step",
                      [&] {
                        layer->zero_grad();
                        x.mutable_grad() = at::Tensor();
                        layer(x).sum().backward();
                      },
                      {}});
  if (n > 1) variants.push_back({"a2a (bare)", bare_a2a, {}});
  for (int round = 0; round < c.warmup + c.steps; ++round) {
    for (auto& v : variants) {
      commgrad::ops::barrier(world);
      const double t0 = now_ms();
      v.run();
      if (round >= c.warmup) v.times.push_back(now_ms() - t0);
    }
  }
  for (auto& v : variants) {
    auto t = at::tensor(v.times, at::kDouble);
    t = commgrad::ops::raw::all_reduce(t, commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kMax), world).wait();
    v.times.assign(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  }
  if (world.rank() == 0) report(c, n, variants, sent_rows);
  commgrad::destroy_process_group();
  return 0;
}
