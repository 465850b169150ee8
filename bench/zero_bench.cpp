// ZeRO and FSDP memory and step time: DistributedDataParallel + Adam against
// ZeroOptimizer stage 1 and 2 (and stage 2 with bfloat16 parameters and
// float32 master weights) and fsdp::fully_shard (one unit per Linear, then
// the root; reshard_after_forward on and off), on one model, in one run.
//
// Memory. Per rank: bytes of parameters, of gradients held after a step's
// backward and of optimizer state, against the ZeRO paper's formulas
// (arXiv 1910.02054; Psi parameters, N ranks; Adam keeps two float32 moments):
//   float32   DDP 4+4+8 Psi,   ZeRO-1 4+4+8/N Psi,   ZeRO-2 4+(4+8)/N Psi,
//             FSDP (4+4+8)/N Psi between steps
//   bf16 + float32 masters     ZeRO-2 2+(2+12)/N Psi  (12: master, m, v)
// and the growth of the process's peak resident set (VmHWM, reset through
// /proc/self/clear_refs) while the variant is built and takes three steps,
// which also counts the transient gradients of backward. For FSDP also the
// largest parameters + gradients + state seen at the layer boundaries of a
// step (DeepMlp's probe), against 16 Psi/N plus the unit that runs
// unsharded (its parameters and gradient, 8 bytes per parameter of the
// largest unit U; without resharding every unit's parameters stay gathered
// from forward to backward: 4 Psi (N-1)/N + 4 U), and the collectives of a
// step (last_step()) against the closed form: an all-gather per unit in
// forward and (resharding) again in backward, a reduce-scatter per unit;
// 3 Psi elements moved per step (2 Psi without resharding; DDP and ZeRO
// move 2 Psi).
//
// Where the allocator keeps freed blocks resident, RSS can grow by what is no
// longer held: FSDP frees and refills a unit's buffer per layer and, with
// glibc's default heap, the freed blocks are not reused for the next unit
// (its RSS rises by about a unit per layer in forward, though the bytes
// held do not; most likely small allocations in between split them). MALLOC_MMAP_THRESHOLD_=524288 (unit-sized blocks
// mmapped and returned on free) makes the RSS column follow the bytes held.
//
// Time. Every round runs one step of each variant (barrier first), so that
// machine noise hits them alike; rank 0 reports median and p10/p90 (and with
// --times FILE writes every measured step's time: bench/fsdp_compare.sh sets
// them beside Python's FSDP2). FSDP prefetches the next unit's all-gather
// from the second step on.
//
//   commgrad-run -n 4 zero_bench [--layers 8] [--width 512] [--batch 32] [--steps 15] [--bucket-cap-mb 4]
//                                [--times FILE]

#include "data_parallel_bench.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
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
// Returns the heap that earlier variants freed to the system first, so that
// a variant's growth is not hidden by pages glibc kept resident.
void reset_peak_rss() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
  std::ofstream("/proc/self/clear_refs") << "5";
}

enum class Kind { kDdp, kZero1, kZero2, kFsdp };

struct Spec {
  const char* name;
  Kind kind;
  bool bf16 = false;
  bool reshard = true;  // FSDP: reshard_after_forward
};

struct Variant {
  Spec spec;
  DeepMlp model{nullptr};
  std::unique_ptr<commgrad::dp::DistributedDataParallel> ddp;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<commgrad::optim::ZeroOptimizer> zero;
  commgrad::fsdp::FullyShardedModule sharded;
  std::vector<double> times;
  bool fsdp() const { return spec.kind == Kind::kFsdp; }
};

std::unique_ptr<torch::optim::Optimizer> adam(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
}

std::unique_ptr<Variant> make_variant(const Spec& s, const DataParallelConfig& c) {
  auto v = std::make_unique<Variant>();
  v->spec = s;
  torch::manual_seed(0);
  v->model = DeepMlp(c);
  if (s.bf16) v->model->to(torch::kBFloat16);
  const auto buckets = commgrad::dp::DistributedDataParallelOptions()
                           .bucket_cap_mb(c.bucket_cap_mb)
                           .first_bucket_cap_mb(std::min(1.0, c.bucket_cap_mb));
  switch (s.kind) {
    case Kind::kDdp:
      v->ddp = std::make_unique<commgrad::dp::DistributedDataParallel>(v->model, buckets);
      v->opt = adam(v->model->parameters());
      break;
    case Kind::kZero1:
    case Kind::kZero2:
      v->zero = std::make_unique<commgrad::optim::ZeroOptimizer>(
          v->model, adam, commgrad::optim::ZeroOptimizerOptions(buckets).stage(s.kind == Kind::kZero1 ? 1 : 2));
      break;
    case Kind::kFsdp: {
      const auto options = commgrad::fsdp::FullyShardOptions().reshard_after_forward(s.reshard);
      for (auto& layer : v->model->layers) commgrad::fsdp::fully_shard(layer, options);
      v->sharded = commgrad::fsdp::fully_shard(v->model, options);
      v->opt = adam(v->model->parameters());  // this rank's pieces
      break;
    }
  }
  return v;
}

// One training step; without `zero_grad` the gradients stay for measure().
double step(Variant& v, const torch::Tensor& x, const torch::Tensor& y, bool zero_grad = true) {
  commgrad::ops::barrier();
  const double start = now_ms();
  auto in = v.spec.bf16 ? x.to(torch::kBFloat16) : x;
  auto out = v.fsdp() ? commgrad::fsdp::call(v.model, in) : v.model->forward(in);
  auto loss = (out.to(torch::kFloat) - y).pow(2).mean();
  loss.backward();
  if (v.zero) {
    v.zero->step();
    if (zero_grad) v.zero->zero_grad();
  } else {
    v.opt->step();
    if (zero_grad) v.opt->zero_grad();
  }
  return now_ms() - start;
}

int64_t bytes_of(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

int64_t adam_state_bytes(torch::optim::Optimizer& opt, const std::vector<torch::Tensor>& params) {
  int64_t bytes = 0;
  for (const auto& p : params) {
    if (auto s = commgrad::optim::get_param_state(opt, p)) {
      for (const auto& t : s->tensors) bytes += bytes_of(t.second);
    }
  }
  return bytes;
}

struct Memory {
  int64_t params = 0, grads = 0, state = 0, peak = 0;
};

Memory measure(Variant& v) {
  Memory m;
  if (v.fsdp()) {
    m.params = v.sharded.parameter_bytes();
    m.grads = v.sharded.gradient_bytes();
    m.state = adam_state_bytes(*v.opt, v.model->parameters());
    return m;
  }
  for (const auto& p : v.model->parameters()) m.params += bytes_of(p);
  if (v.zero) {
    m.grads = v.zero->gradient_bytes();
    m.state = v.zero->state_bytes();
  } else {
    for (const auto& p : v.model->parameters()) {
      if (p.grad().defined()) m.grads += bytes_of(p.grad());
    }
    m.state = adam_state_bytes(*v.opt, v.model->parameters());
  }
  return m;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024 * 1024); }

const std::vector<Spec>& all_specs() {
  static const std::vector<Spec> specs = {{"DDP + Adam", Kind::kDdp},
                                          {"ZeRO-1 + Adam", Kind::kZero1},
                                          {"ZeRO-2 + Adam", Kind::kZero2},
                                          {"ZeRO-2 + Adam, bf16 params, fp32 masters", Kind::kZero2, true},
                                          {"FSDP + Adam, reshard after forward", Kind::kFsdp, false, true},
                                          {"FSDP + Adam, no reshard", Kind::kFsdp, false, false}};
  return specs;
}

// The run's sizes: N ranks, Psi parameters, the largest unit U (one Linear).
struct Sizes {
  int n = 1;
  double unit = 0, psi = 0;
  // Bytes per parameter of the ZeRO paper's closed form.
  double formula(const Spec& s) const {
    if (s.bf16) return 2 + 14.0 / n;
    switch (s.kind) {
      case Kind::kDdp:
        return 16.0;
      case Kind::kZero1:
        return 8 + 8.0 / n;
      case Kind::kZero2:
        return 4 + 12.0 / n;
      case Kind::kFsdp:
        return 16.0 / n;
    }
    return 0.0;
  }
  double state_formula(const Spec& s) const { return (s.bf16 ? 12.0 : 8.0) * psi / (s.kind == Kind::kDdp ? 1 : n); }
};

// What an FSDP variant showed in the memory pass.
struct FsdpReport {
  std::string name;
  bool reshard = true;
  int64_t in_step_peak = 0;
  commgrad::fsdp::StepStats stats;
  std::vector<commgrad::fsdp::UnitInfo> units;
};

void print_memory_header(const DataParallelConfig& c, const Sizes& z) {
  std::printf(
      "zero_bench: %d ranks (%s), %d x Linear(%d, %d): Psi = %.0f parameters (%.1f MiB in fp32), batch %d "
      "per rank, %d steps after %d warm-up, buckets of %.1f MiB\n\n",
      z.n, commgrad::world().backend_name().c_str(), c.layers, c.width, c.width, z.psi, mib(4 * z.psi), c.batch,
      c.steps, c.warmup, c.bucket_cap_mb);
  std::printf(
      "Memory per rank (rank 0) after a step's backward and optimizer step, MiB:\n"
      "| variant | params | grads | optimizer state | state / formula | total | formula "
      "(bytes/param) | total / formula | peak RSS growth |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
}

// Builds variant `s` alone, takes two steps and a third without zero_grad,
// and prints its row (rank 0); an FSDP variant also samples what it holds
// at the layer boundaries of that step into `report`.
void measure_memory(const Spec& s, const DataParallelConfig& c, const Sizes& z, const torch::Tensor& x,
                    const torch::Tensor& y, FsdpReport& report) {
  reset_peak_rss();
  const int64_t before = proc_status_bytes("VmRSS");
  auto v = make_variant(s, c);
  for (int k = 0; k < 2; ++k) step(*v, x, y);
  if (v->fsdp()) {
    const int64_t state = adam_state_bytes(*v->opt, v->model->parameters());
    auto sample = [&] {
      report.in_step_peak =
          std::max(report.in_step_peak, v->sharded.parameter_bytes() + v->sharded.gradient_bytes() + state);
    };
    v->model->probe = sample;
    step(*v, x, y, /*zero_grad=*/false);
    sample();
    v->model->probe = nullptr;
    report.name = s.name;
    report.reshard = s.reshard;
    report.stats = v->sharded.last_step();
    report.units = v->sharded.units();
  } else {
    step(*v, x, y, /*zero_grad=*/false);
  }
  Memory m = measure(*v);
  m.peak = proc_status_bytes("VmHWM") - before;
  const int64_t total = m.params + m.grads + m.state;
  if (commgrad::rank() == 0) {
    std::printf("| %s | %.2f | %.2f | %.2f | %.3f | %.2f | %.2f (%.2f) | %.3f | %.1f |\n", s.name, mib(m.params),
                mib(m.grads), mib(m.state), m.state / z.state_formula(s), mib(total),
                mib(static_cast<int64_t>(z.formula(s) * z.psi)), z.formula(s), total / (z.formula(s) * z.psi),
                mib(m.peak));
  }
}

void print_fsdp_peaks(const std::vector<FsdpReport>& reports, const Sizes& z) {
  std::printf(
      "\nFSDP within a step (rank 0): the most parameters + gradients + optimizer state held at a layer "
      "boundary, MiB;\nclosed form 16 Psi/N + the largest unit's parameters and gradient unsharded "
      "(8 U; no reshard: every unit's parameters\nstay gathered to backward, 4 Psi (N-1)/N + 4 U), "
      "U = %.0f:\n| variant | in-step peak | closed form | peak / closed form |\n|---|---:|---:|---:|\n",
      z.unit);
  for (const auto& r : reports) {
    const double closed = 16 * z.psi / z.n + (r.reshard ? 8 * z.unit : 4 * z.psi * (z.n - 1) / z.n + 4 * z.unit);
    std::printf("| %s | %.2f | %.2f | %.3f |\n", r.name.c_str(), mib(r.in_step_peak), mib(static_cast<int64_t>(closed)),
                r.in_step_peak / closed);
  }
}

void print_fsdp_collectives(const std::vector<FsdpReport>& reports, const Sizes& z) {
  std::printf(
      "\nFSDP collectives per step (rank 0, the last measured step): measured counts x unit size against "
      "the closed\nform (units with parameters: an all-gather each in forward, again in backward when "
      "resharding, a reduce-scatter\neach; volume = elements of the gathered / reduced buffers x 4 bytes; "
      "a ring sends (N-1)/N of it per rank):\n"
      "| variant | all-gathers | (closed form) | prefetched | reduce-scatters | (closed form) | volume MiB | "
      "closed form MiB | volume / Psi | sent per rank MiB |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& r : reports) {
    int64_t with_params = 0, padded = 0;
    for (const auto& u : r.units) {
      if (u.numel > 0) {
        ++with_params;
        padded += u.padded_numel;
      }
    }
    // The root keeps its parameters to backward; the units here are the
    // layers (the root holds none), all of one size.
    const int64_t gathers = with_params * (r.reshard ? 2 : 1), scatters = with_params;
    const double per_unit = with_params > 0 ? static_cast<double>(padded) / with_params : 0;
    const double volume = 4 * per_unit * static_cast<double>(r.stats.all_gathers + r.stats.reduce_scatters);
    const double closed = 4 * z.psi * (r.reshard ? 3 : 2);
    std::printf("| %s | %lld | %lld | %lld | %lld | %lld | %.2f | %.2f | %.3f | %.2f |\n", r.name.c_str(),
                static_cast<long long>(r.stats.all_gathers), static_cast<long long>(gathers),
                static_cast<long long>(r.stats.prefetched), static_cast<long long>(r.stats.reduce_scatters),
                static_cast<long long>(scatters), mib(static_cast<int64_t>(volume)), mib(static_cast<int64_t>(closed)),
                volume / (4 * z.psi), mib(static_cast<int64_t>(volume * (z.n - 1) / z.n)));
  }
}

// Every variant, one step of each per round (so that machine noise hits
// them alike); returns them with the measured steps' times.
std::vector<std::unique_ptr<Variant>> time_variants(const DataParallelConfig& c, const torch::Tensor& x,
                                                    const torch::Tensor& y) {
  std::vector<std::unique_ptr<Variant>> variants;
  for (const auto& s : all_specs()) variants.push_back(make_variant(s, c));
  for (int round = 0; round < c.warmup + c.steps; ++round) {
    for (auto& v : variants) {
      const double t = step(*v, x, y);
      if (round >= c.warmup) v->times.push_back(t);
    }
  }
  return variants;
}

void print_times(const std::vector<std::unique_ptr<Variant>>& variants) {
  std::printf(
      "\nStep time (rank 0), ms:\n| variant | p50 | p10 | p90 | p50 / DDP | p50 / ZeRO-2 |\n"
      "|---|---:|---:|---:|---:|---:|\n");
  const double ddp = percentile(variants[0]->times, 0.5);
  const double zero2 = percentile(variants[2]->times, 0.5);
  for (const auto& v : variants) {
    const double p50 = percentile(v->times, 0.5);
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n", v->spec.name, p50, percentile(v->times, 0.1),
                percentile(v->times, 0.9), p50 / ddp, p50 / zero2);
  }
}

// --times FILE: rank 0's measured step times, one CSV row per step
// (`implementation,backend,ranks,variant,step,ms`; bench/fsdp_compare.py reads them).
void write_times(const std::string& path, const std::vector<std::unique_ptr<Variant>>& variants) {
  std::ofstream out(path);
  out << "implementation,backend,ranks,variant,step,ms\n";
  for (const auto& v : variants) {
    for (size_t k = 0; k < v->times.size(); ++k) {
      out << "commgrad," << commgrad::world().backend_name() << "," << commgrad::world_size() << ",\"" << v->spec.name
          << "\"," << k + 1 << "," << v->times[k] << "\n";
    }
  }
  if (!out) throw std::runtime_error("zero_bench: cannot write " + path);
}

void run(const DataParallelConfig& c, const std::string& times_path) {
  const bool speaker = commgrad::rank() == 0;
  Sizes z;
  z.n = commgrad::world_size();
  z.unit = static_cast<double>(c.width) * c.width + c.width;  // one Linear: the largest unit
  z.psi = c.layers * z.unit;
  torch::manual_seed(1 + commgrad::rank());
  const auto x = torch::randn({c.batch, c.width});
  const auto y = torch::randn({c.batch, c.width});

  if (speaker) print_memory_header(c, z);
  std::vector<FsdpReport> fsdp_reports;
  for (const auto& s : all_specs()) {  // memory: one variant at a time
    FsdpReport report;
    measure_memory(s, c, z, x, y, report);
    if (s.kind == Kind::kFsdp) fsdp_reports.push_back(std::move(report));
  }
  if (speaker) {
    print_fsdp_peaks(fsdp_reports, z);
    print_fsdp_collectives(fsdp_reports, z);
  }
  const auto variants = time_variants(c, x, y);  // time: all variants, interleaved
  if (speaker) {
    print_times(variants);
    if (!times_path.empty()) write_times(times_path, variants);
  }
}

}  // namespace

int main(int argc, char** argv) {
  DataParallelConfig c;
  c.batch = 32;
  c.steps = 15;
  c.bucket_cap_mb = 4;
  std::string times_path;
  if (const auto code = commgrad::bench::parse_config(
          "zero_bench",
          "ZeRO-1/2 and FSDP against DistributedDataParallel + Adam: memory per rank against the ZeRO\n"
          "formulas, FSDP's collectives per step, and step time.\n"
          "  commgrad-run -n 4 zero_bench",
          argc, argv, c, [&](commgrad::cli::App& app) {
            app.add_option("--times", times_path, "rank 0 writes each measured step's time to FILE (CSV)")
                ->type_name("FILE");
          })) {
    return *code;
  }
  try {
    commgrad::init_process_group();
    run(c, times_path);
    commgrad::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
