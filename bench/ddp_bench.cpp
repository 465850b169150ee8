// DDP step time: how much of the gradient all-reduce DistributedDataParallel
// hides behind backward.
//
// One run measures, interleaved round by round so that machine noise hits
// every variant alike:
//   local      forward + backward + SGD step, no communication (no DDP)
//   one-shot   DDP with a single bucket: one all-reduce of every gradient
//              that starts when backward has finished
//   overlap    DDP with several buckets (--bucket-cap-mb) whose all-reduces
//              start while backward is still running
// and the bare all-reduce of a buffer the size of all gradients. Overlap
// efficiency = (one-shot - overlap) / (one-shot - local): the share of the
// exposed communication time that the buckets hide (1 = all of it).
//
//   commgrad-run -n 2 ddp_bench [--layers 8] [--width 512] [--batch 64]
//                               [--steps 20] [--bucket-cap-mb 2]
//
// Every step starts with a barrier; rank 0 reports the median and the p10/p90
// of its step times.

#include "data_parallel_bench.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace {

using commgrad::bench::DataParallelConfig;
using commgrad::bench::DeepMlp;
using commgrad::bench::now_ms;
using commgrad::bench::percentile;

void barrier() { commgrad::ops::barrier(); }

// A trainable model with its optimizer and the data of one step.
struct Variant {
  std::string name;
  DeepMlp model{nullptr};
  std::unique_ptr<torch::optim::SGD> opt;
  std::unique_ptr<commgrad::DistributedDataParallel> ddp;
  std::vector<double> times;
  std::vector<double> waits;  // DDP: end-of-backward wait for the reductions
};

Variant make_variant(const std::string& name, const DataParallelConfig& c, double bucket_cap_mb) {
  Variant v;
  v.name = name;
  torch::manual_seed(0);
  v.model = DeepMlp(c);
  v.opt = std::make_unique<torch::optim::SGD>(v.model->parameters(), torch::optim::SGDOptions(1e-3));
  if (bucket_cap_mb > 0) {
    v.ddp = std::make_unique<commgrad::DistributedDataParallel>(v.model,
                                                                commgrad::DistributedDataParallelOptions()
                                                                    .bucket_cap_mb(bucket_cap_mb)
                                                                    .first_bucket_cap_mb(std::min(1.0, bucket_cap_mb)));
  }
  return v;
}

double step(Variant& v, const torch::Tensor& x, const torch::Tensor& y) {
  barrier();
  const double start = now_ms();
  v.opt->zero_grad();
  torch::mse_loss(v.model->forward(x), y).backward();
  v.opt->step();
  return now_ms() - start;
}

}  // namespace

int main(int argc, char** argv) {
  DataParallelConfig c;
  if (const auto code = commgrad::bench::parse_config(
          "ddp_bench",
          "DDP step time: overlapped buckets against one all-reduce after backward and against none.\n"
          "  commgrad-run -n 2 ddp_bench",
          argc, argv, c)) {
    return *code;
  }
  try {
    commgrad::init_process_group();
    const bool speaker = commgrad::rank() == 0;
    torch::manual_seed(1 + commgrad::rank());
    const auto x = torch::randn({c.batch, c.width});
    const auto y = torch::randn({c.batch, c.width});

    std::vector<Variant> variants;
    variants.push_back(make_variant("local (no communication)", c, 0));
    variants.push_back(make_variant("DDP, one all-reduce after backward", c, 1e6));
    variants.push_back(make_variant("DDP, overlapped buckets", c, c.bucket_cap_mb));
    const auto& overlap_ddp = *variants[2].ddp;

    // The bare all-reduce of all gradients, for scale.
    int64_t numel = 0;
    for (const auto& p : variants[0].model->parameters()) numel += p.numel();
    std::vector<double> allreduce_times;
    std::vector<torch::Tensor> flat{torch::ones({numel})};

    for (int round = 0; round < c.warmup + c.steps; ++round) {
      for (auto& v : variants) {
        const double t = step(v, x, y);
        if (round >= c.warmup) {
          v.times.push_back(t);
          v.waits.push_back(v.ddp ? v.ddp->last_step().wait_ms : 0.0);
        }
      }
      barrier();
      const double start = now_ms();
      commgrad::world().transport().allreduce(flat)->wait();
      if (round >= c.warmup) allreduce_times.push_back(now_ms() - start);
    }

    if (speaker) {
      const double mb = numel * 4.0 / (1024 * 1024);
      std::printf(
          "ddp_bench: %d ranks (%s), %d x Linear(%d, %d) = %.1f MiB of fp32 gradients, batch %d per rank, "
          "%d steps after %d warm-up, intra-op threads %d\n",
          commgrad::world_size(), commgrad::world().backend_name().c_str(), c.layers, c.width, c.width, mb, c.batch,
          c.steps, c.warmup, torch::get_num_threads());
      std::printf("overlap: %zu buckets (first %.1f MiB, then %.1f MiB); %lld of them launched during backward\n",
                  overlap_ddp.buckets().size(), std::min(1.0, c.bucket_cap_mb), c.bucket_cap_mb,
                  static_cast<long long>(overlap_ddp.last_step().launched_in_backward));
      std::printf(
          "| variant | step p50 (ms) | p10 | p90 | end-of-backward wait p50 (ms) |\n"
          "|---|---:|---:|---:|---:|\n");
      std::map<std::string, double> p50;
      for (const auto& v : variants) {
        p50[v.name] = percentile(v.times, 0.5);
        std::printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", v.name.c_str(), p50[v.name], percentile(v.times, 0.1),
                    percentile(v.times, 0.9), percentile(v.waits, 0.5));
      }
      std::printf("| bare all-reduce of %.1f MiB (raw %s transport) | %.2f | %.2f | %.2f | |\n", mb,
                  commgrad::world().backend_name().c_str(), percentile(allreduce_times, 0.5),
                  percentile(allreduce_times, 0.1), percentile(allreduce_times, 0.9));
      const double local = p50[variants[0].name];
      const double oneshot = p50[variants[1].name];
      const double overlap = p50[variants[2].name];
      const double exposed = oneshot - local;
      std::printf("exposed communication: one-shot %.2f ms, overlapped %.2f ms; overlap efficiency %.0f%%\n", exposed,
                  overlap - local, exposed > 0 ? 100.0 * (oneshot - overlap) / exposed : 0.0);
    }
    commgrad::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
