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
// With --link-gbps G (and --link-latency-us T) each row ends with the link
// floor: the bytes that must cross the busiest host link for the op on the
// group's hosts (Collective::link; formulas in docs/benchmarks.md), at G
// Gbit/s, plus T per step among hosts; and xfloor = raw time / floor. "-"
// where the op has no floor or the group lives on one host.

#include "bench.h"

#include "commgrad/dist/process_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
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
  bool check = true;
  bool backward = true;
  double link_gbps = 0;        // 0: no link floor columns
  double link_latency_us = 0;
};

void usage(std::ostream& out) {
  out << "usage: commgrad-run -n N commgrad-bench [options]\n"
         "  --op NAME        all_reduce, all_gather, reduce_scatter, broadcast, reduce, scatter,\n"
         "                   gather, all_to_all, send_recv, or all (default all_reduce)\n"
         "  --backend B      auto, gloo, nccl, shm (default auto)\n"
         "  -b, --minbytes S smallest size (default 4K; K, M, G suffixes)\n"
         "  -e, --maxbytes S largest size (default 64M)\n"
         "  -f, --stepfactor F  multiply the size by F each step (default 2)\n"
         "  -d, --dtype T    float32, float64, float16, bfloat16, int32, int64, int8, uint8\n"
         "  -o, --redop R    sum, avg, max, min, prod (default sum)\n"
         "  -r, --root R     root of broadcast, reduce, scatter, gather (default 0)\n"
         "  -n, --iters I    timed iterations per size (default 20)\n"
         "  -w, --warmup W   untimed iterations first (default 5)\n"
         "  -c, --check 0|1  check results (default 1)\n"
         "  --no-backward    skip the forward+backward columns\n"
         "  --link-gbps G    add the link floor (us) at G Gbit/s per host link, and xfloor\n"
         "  --link-latency-us T  add T per step among hosts to the floor (needs --link-gbps)\n";
}

int64_t parse_size(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  TORCH_CHECK(end != s.c_str() && v >= 0, "commgrad-bench: bad size '", s, "'");
  int64_t mult = 1;
  switch (*end) {
    case 'K': case 'k': mult = 1 << 10; break;
    case 'M': case 'm': mult = 1 << 20; break;
    case 'G': case 'g': mult = int64_t{1} << 30; break;
    case '\0': break;
    default: TORCH_CHECK(false, "commgrad-bench: bad size '", s, "'");
  }
  return static_cast<int64_t>(v * mult);
}

double parse_number(const std::string& option, const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  TORCH_CHECK(end != s.c_str() && *end == '\0' && v >= 0, "commgrad-bench: ", option,
              " needs a non-negative number, got '", s, "'");
  return v;
}

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "float" || s == "fp32") return at::kFloat;
  if (s == "float64" || s == "double" || s == "fp64") return at::kDouble;
  if (s == "float16" || s == "half" || s == "fp16") return at::kHalf;
  if (s == "bfloat16" || s == "bf16") return at::kBFloat16;
  if (s == "int32" || s == "int") return at::kInt;
  if (s == "int64" || s == "long") return at::kLong;
  if (s == "int8") return at::kChar;
  if (s == "uint8") return at::kByte;
  TORCH_CHECK(false, "commgrad-bench: unknown dtype '", s, "'");
}

ReduceOp parse_redop(const std::string& s) {
  if (s == "sum") return ReduceOp::kSum;
  if (s == "avg") return ReduceOp::kAvg;
  if (s == "max") return ReduceOp::kMax;
  if (s == "min") return ReduceOp::kMin;
  if (s == "prod" || s == "product") return ReduceOp::kProduct;
  TORCH_CHECK(false, "commgrad-bench: unknown reduction '", s, "'");
}

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float";
    case at::kDouble: return "double";
    case at::kHalf: return "half";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    default: return "?";
  }
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      TORCH_CHECK(i + 1 < argc, "commgrad-bench: ", a, " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      usage(std::cout);
      std::exit(0);
    } else if (a == "--op") {
      o.op = value();
    } else if (a == "--backend") {
      o.backend = value();
    } else if (a == "-b" || a == "--minbytes") {
      o.min_bytes = parse_size(value());
    } else if (a == "-e" || a == "--maxbytes") {
      o.max_bytes = parse_size(value());
    } else if (a == "-f" || a == "--stepfactor") {
      o.factor = std::max<int64_t>(2, std::stoll(value()));
    } else if (a == "-d" || a == "--dtype") {
      o.dtype = parse_dtype(value());
    } else if (a == "-o" || a == "--redop") {
      o.redop = parse_redop(value());
    } else if (a == "-r" || a == "--root") {
      o.root = std::stoi(value());
    } else if (a == "-n" || a == "--iters") {
      o.iters = std::max(1, std::stoi(value()));
    } else if (a == "-w" || a == "--warmup") {
      o.warmup = std::max(0, std::stoi(value()));
    } else if (a == "-c" || a == "--check") {
      o.check = std::stoi(value()) != 0;
    } else if (a == "--no-backward") {
      o.backward = false;
    } else if (a == "--link-gbps") {
      o.link_gbps = parse_number(a, value());
      TORCH_CHECK(o.link_gbps > 0, "commgrad-bench: --link-gbps needs a positive bandwidth, got ", o.link_gbps);
    } else if (a == "--link-latency-us") {
      o.link_latency_us = parse_number(a, value());
    } else {
      usage(std::cerr);
      TORCH_CHECK(false, "commgrad-bench: unknown option '", a, "'");
    }
  }
  TORCH_CHECK(o.link_latency_us == 0 || o.link_gbps > 0, "commgrad-bench: --link-latency-us needs --link-gbps");
  return o;
}

void barrier(const Group& g) {
  if (g.size() > 1) g.transport().barrier()->wait();
}

// Times in microseconds of each of `fs` over `iters` rounds (t[k][round]),
// after `warmup` untimed rounds. Each round runs every f once, in turn, after
// a barrier, so that load from outside the benchmark (a shared machine) falls
// on all of them alike.
std::vector<std::vector<double>> time_us(const Group& g, int warmup, int iters,
                                         const std::vector<std::function<void()>>& fs) {
  for (int i = 0; i < warmup; ++i) {
    for (const auto& f : fs) f();
  }
  std::vector<std::vector<double>> t(fs.size());
  for (int i = 0; i < iters; ++i) {
    for (size_t k = 0; k < fs.size(); ++k) {
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

void run(const Collective& c, const Options& o, const Group& g) {
  const int n = g.size();
  const bool speaker = g.rank() == 0;
  const int64_t elsize = static_cast<int64_t>(c10::elementSize(o.dtype));
  if (c.name == "send_recv" && n < 2) {
    if (speaker) std::printf("# send_recv needs at least 2 ranks; skipped\n\n");
    return;
  }
  if (speaker) {
    std::printf("# commgrad-bench %s: %d ranks, backend %s, %s, iters %d, warmup %d\n", c.name.c_str(), n,
                g.backend_name().c_str(), dtype_name(o.dtype), o.iters, o.warmup);
    std::printf("#%38s | %-31s | %-31s | %-21s | %-14s |%s\n", "", "raw transport call", "differentiable forward",
                o.backward ? "forward+backward" : "", o.backward ? "autograd floor" : "",
                o.link_gbps > 0 ? "        | link floor" : "");
    const char* floor_head = o.link_gbps > 0 ? " |    floor xfloor" : "";
    const char* floor_unit = o.link_gbps > 0 ? " |     (us) (raw)" : "";
    std::printf("#%11s %10s %8s %6s %4s | %8s %7s %7s %6s | %8s %7s %7s %6s | %8s %7s %4s | %8s %5s | %6s%s\n",
                "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
                "busbw", "#wrong", "time", "busbw", "xraw", "time", "net", "ovh", floor_head);
    std::printf("#%11s %10s %8s %6s %4s | %8s %7s %7s %6s | %8s %7s %7s %6s | %8s %7s %4s | %8s %5s | %6s%s\n",
                "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "",
                "(us)", "(GB/s)", "", "(us)", "xraw", "(%)", floor_unit);
  }
  double sum_raw = 0, sum_op = 0;
  int rows = 0;
  const auto layout = ranks_per_host(g);
  for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
    int64_t count = std::max<int64_t>(bytes / elsize, 1);
    if (c.per_rank_split) count = std::max<int64_t>(count / n, 1) * n;
    Setup s;
    s.group = g;
    s.rank = g.rank();
    s.size = n;
    s.dtype = o.dtype;
    s.count = count;
    s.op = o.redop;
    s.root = o.root;
    Instance in = c.make(s);
    const bool fb = o.backward && in.forward_backward != nullptr;
    // The result is dropped inside the timed call (as a training step drops
    // it), so its memory is reused like the raw call's buffer.
    std::vector<std::function<void()>> fs{in.raw, [&] { in.op(in.input); }};
    if (fb) {
      fs.push_back(in.forward_backward);
      fs.push_back(autograd_floor(in.input));
    }
    const auto t = time_us(g, o.warmup, o.iters, fs);
    const double t_raw = median(t[0]), t_op = median(t[1]);
    const double t_fb = fb ? median(t[2]) : 0, t_floor = fb ? median(t[3]) : 0;
    const double ovh = paired_overhead_pct(t[1], t[0]);
    int64_t wrong_raw = 0, wrong_op = 0;
    if (o.check) {
      barrier(g);
      wrong_raw = sum_over_ranks(g, in.check_raw());
      wrong_op = sum_over_ranks(g, in.check_op(in.op(in.input)));
    }
    const double size = static_cast<double>(count * elsize);
    const double factor = c.bus_factor(n);
    if (speaker) {
      const char* redop = c.has_redop ? reduce_op_name(o.redop) : "none";
      const int root = c.has_root ? o.root : -1;
      std::printf(" %11lld %10lld %8s %6s %4d | %8.1f %7.3f %7.3f %6lld | %8.1f %7.3f %7.3f %6lld | ",
                  static_cast<long long>(size), static_cast<long long>(count), dtype_name(o.dtype), redop, root,
                  t_raw, gbps(size, t_raw), gbps(size, t_raw) * factor, static_cast<long long>(wrong_raw), t_op,
                  gbps(size, t_op), gbps(size, t_op) * factor, static_cast<long long>(wrong_op));
      if (fb) {
        std::printf("%8.1f %7.3f %4.2f | %8.1f %5.2f | ", t_fb, gbps(2 * size, t_fb) * factor, t_fb / t_raw, t_floor,
                    (t_fb - t_floor) / t_raw);
      } else {
        std::printf("%8s %7s %4s | %8s %5s | ", "n/a", "", "", "n/a", "");
      }
      std::printf("%+6.1f", ovh);
      if (o.link_gbps > 0) {
        const double floor = link_floor_us(c, o, layout, size);
        if (floor > 0) {
          std::printf(" | %8.1f %6.2f", floor, t_raw / floor);
        } else {
          std::printf(" | %8s %6s", "-", "-");
        }
      }
      std::printf("\n");
      std::fflush(stdout);
    }
    sum_raw += gbps(size, t_raw) * factor;
    sum_op += gbps(size, t_op) * factor;
    ++rows;
  }
  if (speaker && rows > 0) {
    std::printf("# Avg bus bandwidth: raw %.3f GB/s, differentiable forward %.3f GB/s\n\n", sum_raw / rows,
                sum_op / rows);
  }
}

}  // namespace
}  // namespace commgrad::bench

int main(int argc, char** argv) {
  using namespace commgrad::bench;
  try {
    const Options o = parse(argc, argv);
    std::vector<const Collective*> chosen;
    for (const auto& c : collectives()) {
      if (o.op == "all" || o.op == c.name) chosen.push_back(&c);
    }
    TORCH_CHECK(!chosen.empty(), "commgrad-bench: unknown --op '", o.op,
                "' (all_reduce, all_gather, reduce_scatter, broadcast, reduce, scatter, gather, all_to_all, "
                "send_recv, all)");
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
