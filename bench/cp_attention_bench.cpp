// Context-parallel attention: forward + backward time, peak memory and bytes
// moved per rank, for one configuration (bench/cp_attention_bench.sh runs
// the grid: sequences 1k-8k, CP = 1, 2, 4, the three modes).
//
//   commgrad-run -n 2 cp_attention_bench --seq 4096 --mode ring
//   cp_attention_bench --seq 4096                   CP = 1: full attention, one rank
//
// Options: --seq 4096 --heads 4 --head-dim 64 --batch 1 --mode ring|allgather|ulysses
//          --steps 5 --warmup 1 --causal 1; one intra-op thread per rank.
//
// One step is cp::attention of q, k, v [batch, heads, seq/W, head_dim]
// (float32, head-tail layout), then backward of sum(out * w). Rank 0 prints
// one row: the median over steps of the slowest rank's time, the peak
// resident memory the steps added on the busiest rank (getrusage's maxrss
// over the RSS after the warm-up steps: the attention's activations and
// temporaries, measured, not a formula; a peak of the warm-up counts too, and
// the heap may keep freed small blocks resident), and the bytes a rank sent per
// step (the ring counts them; all-gather and Ulysses by their closed form)
// against the closed form.

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace cp = commgrad::cp;

namespace {

struct Config {
  int64_t seq = 4096, heads = 4, head_dim = 64, batch = 1;
  std::string mode = "ring";
  int steps = 5, warmup = 1;
  bool causal = true;
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double rss_mb() {  // current resident set, from /proc
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * 4096.0 / (1 << 20);
}

double max_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;
}

// Bytes one rank sends per step (forward + backward), P = one part of K (or V).
double closed_form_bytes(const std::string& mode, int w, double part) {
  if (w == 1) return 0;
  if (mode == "allgather") return 4.0 * (w - 1) * part;    // all-gather K,V; reduce-scatter dK,dV
  if (mode == "ulysses") return 8.0 * (w - 1) / w * part;  // q,k,v and out, forward and backward
  return 4.0 * (w - 1) * part + 2.0 * w * part;            // ring: K/V twice, dK/dV W times
}

std::optional<int> parse(int argc, char** argv, Config& c) {
  namespace cli = commgrad::cli;
  cli::App app("cp_attention_bench",
               "Context-parallel attention: forward+backward time, peak memory, bytes per rank.\n"
               "  commgrad-run -n 2 cp_attention_bench --seq 4096 --mode ring");
  app.add_option("--seq", c.seq, "tokens of the whole sequence")->check(cli::positive<int64_t>());
  app.add_option("--heads", c.heads, "attention heads")->check(cli::positive<int64_t>());
  app.add_option("--head-dim", c.head_dim, "size of a head")->check(cli::positive<int64_t>());
  app.add_option("--batch", c.batch, "sequences")->check(cli::positive<int64_t>());
  app.add_option("--mode", c.mode, "ring, allgather or ulysses")->check(cli::one_of({"ring", "allgather", "ulysses"}));
  app.add_option("--steps", c.steps, "measured steps")->check(cli::positive());
  app.add_option("--warmup", c.warmup, "untimed steps first")->check(cli::non_negative());
  app.add_option("--causal", c.causal, "causal mask (1) or none (0)");
  return cli::parse(app, argc, argv);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  if (const auto code = parse(argc, argv, c)) return *code;
  auto world = commgrad::init_process_group();
  at::set_num_threads(1);
  commgrad::set_blas_threads(1);
  const int w = world.size();
  const int64_t local = c.seq / w;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1 + world.rank());
  auto make = [&] { return at::rand({c.batch, c.heads, local, c.head_dim}, gen).requires_grad_(); };
  const at::Tensor q = make(), k = make(), v = make(), weight = at::rand({c.batch, c.heads, local, c.head_dim}, gen);
  auto counters = std::make_shared<cp::RingCounters>();
  const auto options = cp::ContextParallelOptions(world, cp::parse_mode(c.mode)).causal(c.causal).counters(counters);

  double rss_before = rss_mb();
  std::vector<double> times;
  for (int s = 0; s < c.warmup + c.steps; ++s) {
    if (s == c.warmup && s > 0) rss_before = rss_mb();  // after what the first step set up for good
    for (const auto& x : {q, k, v}) x.mutable_grad() = at::Tensor();
    commgrad::ops::barrier(world);
    const double t0 = now_ms();
    (cp::attention(q, k, v, options) * weight).sum().backward();
    const double t1 = now_ms();
    if (s >= c.warmup) times.push_back(t1 - t0);
  }
  const double peak = max_rss_mb() - rss_before;
  const auto max = commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kMax);
  auto t = commgrad::ops::raw::all_reduce(at::tensor(times, at::kDouble), max, world).wait();
  std::vector<double> slowest(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  std::sort(slowest.begin(), slowest.end());
  const double peak_max =
      commgrad::ops::raw::all_reduce(at::tensor({peak}, at::kDouble), max, world).wait().item<double>();
  const double part = static_cast<double>(c.batch * c.heads * local * c.head_dim * 4);
  const double closed = closed_form_bytes(c.mode, w, part);
  const double measured =
      c.mode == "ring" && w > 1 ? counters->bytes_sent / static_cast<double>(c.warmup + c.steps) : closed;
  if (world.rank() == 0) {
    std::printf("%-9s %3d %6ld %10.1f %10.1f %12.2f %12.2f\n", w == 1 ? "none" : c.mode.c_str(), w,
                static_cast<long>(c.seq), slowest[slowest.size() / 2], peak_max, measured / (1 << 20),
                closed / (1 << 20));
  }
  commgrad::destroy_process_group();
  return 0;
}
