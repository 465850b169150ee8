// commgrad-bench: nccl-tests-style tables for commgrad's collectives.
//
//   commgrad-run -n 4 commgrad-bench --op all_reduce -b 4K -e 64M -f 4
//
// For each size it times, on every rank and each after a barrier: the bare
// c10d transport call on preallocated buffers ("raw"), the differentiable
// op's forward, its forward+backward (two collectives), and the autograd
// floor: forward+backward of a one-node graph on one element, without
// communication (what LibTorch's engine costs per backward() call). Each
// is the median over --iters timed rounds after --warmup untimed ones; a
// round runs them in turn, so load from outside falls on all alike.
//
// Rank 0 prints one line per size: size in bytes and elements, dtype,
// reduction and root; time (us), algbw = size/time and busbw = algbw x the
// nccl-tests bus factor (GB/s) and #wrong (results checked against expected
// values, summed over ranks) for the raw call and the forward;
// forward+backward's time, busbw and multiple of one raw call; the floor's
// time and net = (forward+backward - floor) / raw; and ovh, the forward's
// overhead over the raw call in percent (the median over rounds of each
// round's own ratio, which cancels slow drift of a shared machine).
//
// With --raw-only it times the raw call alone, back to back (as nccl-tests
// and an MPI benchmark do): interleaved with the op, whose input and fresh
// output evict the raw call's buffer, a 16 MiB all_reduce on 2 ranks reads
// its buffer from memory instead of the cache and takes 1.5x as long. The
// transport comparison (bench/compare_transports.sh) uses it.
//
// With --sweeps S it sweeps the sizes S times and prints, per size, the
// median over the sweeps of each column. On a VM whose host moves the
// vCPUs between cores (here: cross-core round trips of about 40, 125 and
// 430 ns, changing within seconds, see bench/core_latency.c) one sweep
// measures each size in whichever placement held at that moment; several
// sweeps spread every size over the placements.
//
// With --fresh-input every rank writes what the raw call reads (its source:
// the buffer, the input, a root's tensor) again before each call, outside
// the timing, with the input's values, as a training step's tensors are
// freshly written: back to back, a source unchanged since the last call
// may still sit in the readers' caches, which flatters a transport that
// reads it in place (bench/mpi_collectives.c has the same option).
//
// With --link-gbps G (and --link-latency-us T) each row ends with the link
// floor: the bytes that must cross the busiest host link for the op on the
// group's hosts (Collective::link; formulas in docs/benchmarks.md), at G
// Gbit/s, plus T per step among hosts; and xfloor = raw time / floor. "-"
// where the op has no floor or the group lives on one host.

#include "bench.h"

#include "commgrad/dist/process_group.h"
#include "commgrad/util/names.h"

#include "cli/cli.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::bench {
namespace {

struct Options {
  std::string op = "all_reduce";
  std::string backend = "auto";
  int64_t min_bytes = 4 << 10;
  int64_t max_bytes = 64 << 20;
  int64_t factor = 2;
  at::ScalarType dtype = at::kFloat;
  ReduceOp redop = ReduceOp::kSum;
  int root = 0;
  int iters = 20;
  int warmup = 5;
  int sweeps = 1;
  bool check = true;
  bool backward = true;
  bool raw_only = false;
  bool fresh_input = false;
  int64_t offset_bytes = 0;
  double link_gbps = 0;  // 0: no link floor columns
  double link_latency_us = 0;
};

// "4K" -> 4096 (K, M, G: powers of 1024; fractions allowed); nothing when not a size.
std::optional<int64_t> parse_size(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !(v >= 0) || v > 1e15) return std::nullopt;
  int64_t mult = 1;
  switch (*end) {
    case 'K':
    case 'k':
      mult = 1 << 10;
      break;
    case 'M':
    case 'm':
      mult = 1 << 20;
      break;
    case 'G':
    case 'g':
      mult = int64_t{1} << 30;
      break;
    case '\0':
      break;
    default:
      return std::nullopt;
  }
  if (*end != '\0' && end[1] != '\0') return std::nullopt;
  return static_cast<int64_t>(v * mult);
}

std::optional<at::ScalarType> parse_dtype(const std::string& s) {
  if (s == "float32" || s == "float" || s == "fp32") return at::kFloat;
  if (s == "float64" || s == "double" || s == "fp64") return at::kDouble;
  if (s == "float16" || s == "half" || s == "fp16") return at::kHalf;
  if (s == "bfloat16" || s == "bf16") return at::kBFloat16;
  if (s == "int32" || s == "int") return at::kInt;
  if (s == "int64" || s == "long") return at::kLong;
  if (s == "int8") return at::kChar;
  if (s == "uint8") return at::kByte;
  return std::nullopt;
}

std::optional<ReduceOp> parse_redop(const std::string& s) {
  if (s == "sum") return ReduceOp::kSum;
  if (s == "avg") return ReduceOp::kAvg;
  if (s == "max") return ReduceOp::kMax;
  if (s == "min") return ReduceOp::kMin;
  if (s == "prod" || s == "product") return ReduceOp::kProduct;
  return std::nullopt;
}

// A validator that accepts what `parse` turns into a value.
template <class Parse>
CLI::Validator parses(Parse parse, std::string what) {
  return CLI::Validator(
      [parse, what](std::string& text) { return parse(text) ? std::string() : what + ", got '" + text + "'"; }, "",
      what);
}

// The options of the command line into `o`; the exit code when the program
// ends here (--help, or a bad command line, named on stderr with exit code 2).
std::optional<int> parse(int argc, char** argv, Options& o) {
  std::string op_names;
  for (const auto& c : collectives()) op_names += c.name + std::string(", ");
  op_names += "all";
  cli::App app("commgrad-bench",
               "nccl-tests-style tables for commgrad's collectives: the raw transport call against the\n"
               "differentiable op, forward and forward+backward.\n"
               "  commgrad-run -n N commgrad-bench [options]");
  app.add_option("--op", o.op, op_names)->type_name("NAME");
  app.add_option("--backend", o.backend, "auto, gloo, nccl, shm")->type_name("B");
  app.add_option_function<std::string>(
         "-b,--minbytes", [&o](const std::string& s) { o.min_bytes = *parse_size(s); },
         "smallest size (K, M, G suffixes; default 4K)")
      ->type_name("S")
      ->check(parses(parse_size, "expected a size in bytes such as 4K, 1M or 1G"));
  app.add_option_function<std::string>(
         "-e,--maxbytes", [&o](const std::string& s) { o.max_bytes = *parse_size(s); }, "largest size (default 64M)")
      ->type_name("S")
      ->check(parses(parse_size, "expected a size in bytes such as 4K, 1M or 1G"));
  app.add_option("-f,--stepfactor", o.factor, "multiply the size by F each step")
      ->type_name("F")
      ->check(cli::integer<int64_t>(2));
  app.add_option_function<std::string>(
         "-d,--dtype", [&o](const std::string& s) { o.dtype = *parse_dtype(s); },
         "float32, float64, float16, bfloat16, int32, int64, int8,\n"
         "uint8 (default float32)")
      ->type_name("T")
      ->check(parses(parse_dtype, "expected float32, float64, float16, bfloat16, int32, int64, int8 or uint8"));
  app.add_option_function<std::string>(
         "-o,--redop", [&o](const std::string& s) { o.redop = *parse_redop(s); },
         "sum, avg, max, min, prod (default sum)")
      ->type_name("R")
      ->check(parses(parse_redop, "expected sum, avg, max, min or prod"));
  app.add_option("-r,--root", o.root, "root of broadcast, reduce, scatter, gather")
      ->type_name("R")
      ->check(cli::non_negative());
  app.add_option("-n,--iters", o.iters, "timed iterations per size")->type_name("I")->check(cli::positive());
  app.add_option("-w,--warmup", o.warmup, "untimed iterations first")->type_name("W")->check(cli::non_negative());
  app.add_option("--sweeps", o.sweeps, "sweep the sizes S times; print each size's median over the sweeps")
      ->type_name("S")
      ->check(cli::positive());
  app.add_option("-c,--check", o.check, "check results (0 or 1)")->type_name("0|1")->check(cli::integer(0, 1));
  app.add_flag_callback(
      "--no-backward", [&o] { o.backward = false; }, "skip the forward+backward columns");
  app.add_flag_callback(
      "--raw-only",
      [&o] {
        o.raw_only = true;
        o.backward = false;
      },
      "time the raw transport call alone (no differentiable columns;\n"
      "what a transport comparison needs)");
  app.add_flag("--fresh-input", o.fresh_input,
               "write the raw call's source again before each call, untimed\n"
               "(as a training step's tensors are freshly written)");
  app.add_option("--offset", o.offset_bytes,
                 "start the raw call's buffers B bytes past a 64-byte boundary,\n"
                 "as slices of a flat buffer do (0-4095, a multiple of the element size)")
      ->type_name("B")
      ->check(cli::integer<int64_t>(0, 4095));
  app.add_option("--link-gbps", o.link_gbps, "add the link floor (us) at G Gbit/s per host link, and xfloor")
      ->type_name("G")
      ->check(cli::number(0, /*inclusive=*/false));
  app.add_option("--link-latency-us", o.link_latency_us, "add T per step among hosts to the floor (needs --link-gbps)")
      ->type_name("T")
      ->check(cli::number(0, /*inclusive=*/true));
  return cli::parse(app, argc, argv, [&o, &op_names] {
    bool known = o.op == "all";
    for (const auto& c : collectives()) known = known || o.op == c.name;
    if (!known) throw cli::usage_error("unknown --op '" + o.op + "' (" + op_names + ")");
    if (o.link_latency_us != 0 && o.link_gbps <= 0) throw cli::usage_error("--link-latency-us needs --link-gbps");
    const auto elsize = static_cast<int64_t>(c10::elementSize(o.dtype));
    if (o.offset_bytes % elsize != 0) {
      throw cli::usage_error("--offset " + std::to_string(o.offset_bytes) + " is not a multiple of " +
                             dtype_name(o.dtype) + "'s " + std::to_string(elsize) + " bytes");
    }
  });
}

void barrier(const Group& g) {
  if (g.size() > 1) g.transport().barrier()->wait();
}

// Times in microseconds of each of `fs` over `iters` rounds (t[k][round]),
// after `warmup` untimed rounds. Each round runs every f once, in turn, after
// a barrier, so that load from outside the benchmark (a shared machine) falls
// on all of them alike. `prepare` (if any) runs before fs[0], untimed.
std::vector<std::vector<double>> time_us(const Group& g, int warmup, int iters,
                                         const std::vector<std::function<void()>>& fs,
                                         const std::function<void()>& prepare) {
  for (int i = 0; i < warmup; ++i) {
    for (size_t k = 0; k < fs.size(); ++k) {
      if (k == 0 && prepare) prepare();
      fs[k]();
    }
  }
  std::vector<std::vector<double>> t(fs.size());
  for (int i = 0; i < iters; ++i) {
    for (size_t k = 0; k < fs.size(); ++k) {
      if (k == 0 && prepare) prepare();
      barrier(g);
      const auto start = std::chrono::steady_clock::now();
      fs[k]();
      t[k].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    }
  }
  return t;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The median over rounds of a[i] / b[i] - 1, in percent.
double paired_overhead_pct(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (b[i] > 0) r.push_back(100.0 * (a[i] / b[i] - 1));
  }
  return median(r);
}

// The autograd floor: forward+backward of a one-node graph on one element of
// x's dtype, without communication. What LibTorch's engine costs per
// backward() call, whatever the op (size-dependent local work excluded: a
// fresh tensor of 32 MiB and more is a new mmap, so on some machines a local
// copy of that size costs more than the collective).
std::function<void()> autograd_floor(const at::Tensor& x) {
  auto leaf = at::ones({1}, x.options()).requires_grad_(true);
  auto grad = at::ones({1}, x.options());
  return [leaf, grad]() mutable {
    leaf.mutable_grad() = at::Tensor();
    auto y = leaf.clone();
    torch::autograd::backward({y}, {grad});
  };
}

// Sum over ranks (reported by rank 0).
int64_t sum_over_ranks(const Group& g, int64_t v) {
  if (g.size() == 1) return v;
  std::vector<at::Tensor> t{at::full({1}, v, at::kLong)};
  g.transport().allreduce(t)->wait();
  return t[0].item<int64_t>();
}

double gbps(double bytes, double us) { return us > 0 ? bytes / us / 1e3 : 0; }

// Ranks per host of `g`, hosts in the order of their first rank.
std::vector<int> ranks_per_host(const Group& g) {
  const auto& hosts = g.state()->hosts;
  std::vector<std::string> seen;
  std::vector<int> counts;
  for (const auto& h : hosts) {
    const auto it = std::find(seen.begin(), seen.end(), h);
    if (it == seen.end()) {
      seen.push_back(h);
      counts.push_back(1);
    } else {
      ++counts[it - seen.begin()];
    }
  }
  return counts;
}

// The link floor in microseconds for `size` bytes (0: none).
double link_floor_us(const Collective& c, const Options& o, const std::vector<int>& layout, double size) {
  if (!c.link || o.link_gbps <= 0) return 0;
  const LinkCost cost = c.link(layout);
  if (cost.volume <= 0) return 0;
  return cost.volume * size * 8 / (o.link_gbps * 1e3) + cost.rounds * o.link_latency_us;
}

void print_header(const Collective& c, const Options& o, const Group& g) {
  const std::string offset = o.offset_bytes > 0 ? ", offset " + std::to_string(o.offset_bytes) + " B" : "";
  std::printf("# commgrad-bench %s: %d ranks, backend %s, %s, iters %d, warmup %d, sweeps %d%s%s\n", c.name.c_str(),
              g.size(), g.backend_name().c_str(), dtype_name(o.dtype), o.iters, o.warmup, o.sweeps,
              o.fresh_input ? ", fresh input" : "", offset.c_str());
  std::printf("#%38s | %-31s | %-31s | %-21s | %-14s |%s\n", "", "raw transport call", "differentiable forward",
              o.backward ? "forward+backward" : "", o.backward ? "autograd floor" : "",
              o.link_gbps > 0 ? "        | link floor" : "");
  const char* floor_head = o.link_gbps > 0 ? " |    floor xfloor" : "";
  const char* floor_unit = o.link_gbps > 0 ? " |     (us) (raw)" : "";
  std::printf("#%11s %10s %8s %6s %4s | %8s %7s %7s %6s | %8s %7s %7s %6s | %8s %7s %4s | %8s %5s | %6s%s\n", "size",
              "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong",
              "time", "busbw", "xraw", "time", "net", "ovh", floor_head);
  std::printf("#%11s %10s %8s %6s %4s | %8s %7s %7s %6s | %8s %7s %7s %6s | %8s %7s %4s | %8s %5s | %6s%s\n", "(B)",
              "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)",
              "(GB/s)", "", "(us)", "xraw", "(%)", floor_unit);
}

// One size's measurements (medians in microseconds).
struct Row {
  int64_t count = 0;
  double size = 0;  // bytes
  double t_raw = 0, t_op = 0, t_fb = 0, t_floor = 0, ovh = 0;
  bool op = false;  // the differentiable forward measured
  bool fb = false;  // forward+backward measured
  int64_t wrong_raw = 0, wrong_op = 0;
};

Row measure(const Collective& c, const Options& o, const Group& g, int64_t count) {
  Setup s;
  s.group = g;
  s.rank = g.rank();
  s.size = g.size();
  s.dtype = o.dtype;
  s.count = count;
  s.op = o.redop;
  s.root = o.root;
  s.offset_bytes = o.offset_bytes;
  Instance in = c.make(s);
  Row row;
  row.count = count;
  row.size = static_cast<double>(count * static_cast<int64_t>(c10::elementSize(o.dtype)));
  row.op = !o.raw_only;
  row.fb = o.backward && in.forward_backward != nullptr;
  // The result is dropped inside the timed call (as a training step drops
  // it), so its memory is reused like the raw call's buffer.
  std::vector<std::function<void()>> fs{in.raw};
  if (row.op) fs.push_back([&] { in.op(in.input); });
  if (row.fb) {
    fs.push_back(in.forward_backward);
    fs.push_back(autograd_floor(in.input));
  }
  std::function<void()> refresh;
  if (o.fresh_input && in.raw_source.defined()) {
    // The input's values, so that results stay checkable (and in-place sums finite).
    refresh = [source = in.raw_source, values = in.raw_source.clone()]() mutable { source.copy_(values); };
  }
  const auto t = time_us(g, o.warmup, o.iters, fs, refresh);
  row.t_raw = median(t[0]);
  row.t_op = row.op ? median(t[1]) : 0;
  row.t_fb = row.fb ? median(t[2]) : 0;
  row.t_floor = row.fb ? median(t[3]) : 0;
  row.ovh = row.op ? paired_overhead_pct(t[1], t[0]) : 0;
  if (o.check) {
    barrier(g);
    row.wrong_raw = sum_over_ranks(g, in.check_raw());
    if (row.op) row.wrong_op = sum_over_ranks(g, in.check_op(in.op(in.input)));
  }
  return row;
}

// Per column, the median over `rows` (one size's sweeps); results checked
// wrong in any sweep count.
Row median_row(const std::vector<Row>& rows) {
  auto column = [&rows](double Row::*field) {
    std::vector<double> v;
    for (const Row& r : rows) v.push_back(r.*field);
    return median(v);
  };
  Row m = rows.front();
  m.t_raw = column(&Row::t_raw);
  m.t_op = column(&Row::t_op);
  m.t_fb = column(&Row::t_fb);
  m.t_floor = column(&Row::t_floor);
  m.ovh = column(&Row::ovh);
  for (const Row& r : rows) {
    m.wrong_raw = std::max(m.wrong_raw, r.wrong_raw);
    m.wrong_op = std::max(m.wrong_op, r.wrong_op);
  }
  return m;
}

void print_row(const Collective& c, const Options& o, const Row& r, double factor, const std::vector<int>& layout) {
  const char* redop = c.has_redop ? reduce_op_name(o.redop) : "none";
  const int root = c.has_root ? o.root : -1;
  std::printf(" %11lld %10lld %8s %6s %4d | %8.2f %7.3f %7.3f %6lld | ", static_cast<long long>(r.size),
              static_cast<long long>(r.count), dtype_name(o.dtype), redop, root, r.t_raw, gbps(r.size, r.t_raw),
              gbps(r.size, r.t_raw) * factor, static_cast<long long>(r.wrong_raw));
  if (r.op) {
    std::printf("%8.2f %7.3f %7.3f %6lld | ", r.t_op, gbps(r.size, r.t_op), gbps(r.size, r.t_op) * factor,
                static_cast<long long>(r.wrong_op));
  } else {
    std::printf("%8s %7s %7s %6s | ", "n/a", "", "", "");
  }
  if (r.fb) {
    std::printf("%8.1f %7.3f %4.2f | %8.1f %5.2f | ", r.t_fb, gbps(2 * r.size, r.t_fb) * factor, r.t_fb / r.t_raw,
                r.t_floor, (r.t_fb - r.t_floor) / r.t_raw);
  } else {
    std::printf("%8s %7s %4s | %8s %5s | ", "n/a", "", "", "n/a", "");
  }
  if (r.op) {
    std::printf("%+6.1f", r.ovh);
  } else {
    std::printf("%6s", "n/a");
  }
  if (o.link_gbps > 0) {
    const double floor = link_floor_us(c, o, layout, r.size);
    if (floor > 0) {
      std::printf(" | %8.1f %6.2f", floor, r.t_raw / floor);
    } else {
      std::printf(" | %8s %6s", "-", "-");
    }
  }
  std::printf("\n");
  std::fflush(stdout);
}

void run(const Collective& c, const Options& o, const Group& g) {
  const int n = g.size();
  const bool speaker = g.rank() == 0;
  const int64_t elsize = static_cast<int64_t>(c10::elementSize(o.dtype));
  if (c.name == "send_recv" && n < 2) {
    if (speaker) std::printf("# send_recv needs at least 2 ranks; skipped\n\n");
    return;
  }
  if (speaker) print_header(c, o, g);
  double sum_raw = 0, sum_op = 0;
  int rows = 0;
  const auto layout = ranks_per_host(g);
  const double factor = c.bus_factor(n);
  std::vector<int64_t> counts;
  for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
    int64_t count = std::max<int64_t>(bytes / elsize, 1);
    if (c.per_rank_split) count = std::max<int64_t>(count / n, 1) * n;
    counts.push_back(count);
  }
  std::vector<std::vector<Row>> sweeps(counts.size());
  for (int sweep = 0; sweep < o.sweeps; ++sweep) {
    for (size_t i = 0; i < counts.size(); ++i) {
      sweeps[i].push_back(measure(c, o, g, counts[i]));
      // One sweep prints as it goes; several print once every size has all of its sweeps.
      if (speaker && o.sweeps == 1) print_row(c, o, sweeps[i].back(), factor, layout);
    }
  }
  for (const auto& measured : sweeps) {
    const Row row = median_row(measured);
    if (speaker && o.sweeps > 1) print_row(c, o, row, factor, layout);
    sum_raw += gbps(row.size, row.t_raw) * factor;
    sum_op += gbps(row.size, row.t_op) * factor;
    ++rows;
  }
  if (speaker && rows > 0) {
    if (o.raw_only) {
      std::printf("# Avg bus bandwidth: raw %.3f GB/s\n\n", sum_raw / rows);
    } else {
      std::printf("# Avg bus bandwidth: raw %.3f GB/s, differentiable forward %.3f GB/s\n\n", sum_raw / rows,
                  sum_op / rows);
    }
  }
}

}  // namespace
}  // namespace commgrad::bench

int main(int argc, char** argv) {
  using namespace commgrad::bench;
  try {
    Options o;
    if (const auto code = parse(argc, argv, o)) return *code;
    std::vector<const Collective*> chosen;
    for (const auto& c : collectives()) {
      if (o.op == "all" || o.op == c.name) chosen.push_back(&c);
    }
    auto world = commgrad::init_process_group(commgrad::InitOptions().backend(o.backend));
    TORCH_CHECK(o.root >= 0 && o.root < world.size(), "commgrad-bench: --root ", o.root, " is outside 0..",
                world.size() - 1);
    for (const auto* c : chosen) run(*c, o, world);
    commgrad::destroy_process_group();
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "commgrad-bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
