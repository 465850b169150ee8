// A rank program made to hang, run by flight_recorder_test through
// commgrad-run: every step all-reduces a gradient on the world and a metric
// on a second group ("metrics"), as a training loop does. At step 1 rank
// <rank> of `--skip <rank>` skips the gradient all_reduce (it goes on to the
// metric's, which the others never reach); with `--mismatch <rank>` it
// all-gathers the gradient where the others all-reduce it. The job ends at
// the group timeout (`--timeout`, seconds) or at the transport's mismatch
// error, and every rank leaves its flight record.

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <chrono>
#include <exception>
#include <iostream>
#include <vector>

#include "cli/cli.h"

int main(int argc, char** argv) {
  int skip = -1;
  int mismatch = -1;
  double timeout_s = 3;
  commgrad::cli::App app("flight_recorder_job", "A job in which one rank skips or changes a collective.");
  app.add_option("--skip", skip, "the rank that skips the gradient all_reduce of step 1");
  app.add_option("--mismatch", mismatch, "the rank that all-gathers the gradient of step 1 instead");
  app.add_option("--timeout", timeout_s, "group timeout in seconds")->check(commgrad::cli::number(0, false));
  if (const auto code = commgrad::cli::parse(app, argc, argv)) return *code;

  namespace ops = commgrad::ops;
  try {
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    auto world = commgrad::init_process_group(commgrad::InitOptions().timeout(timeout));
    std::vector<int> all(world.size());
    for (int r = 0; r < world.size(); ++r) all[r] = r;
    auto metrics = commgrad::new_group(all, commgrad::NewGroupOptions().name("metrics"));
    const int rank = world.rank();
    for (int step = 0; step < 3; ++step) {
      auto grad = torch::full({8}, static_cast<float>(rank + step));
      if (step == 1 && rank == mismatch) {
        ops::all_gather(grad, ops::AllGatherOptions(), world);
      } else if (!(step == 1 && rank == skip)) {
        ops::all_reduce(grad, ops::AllReduceOptions(), world);
      }
      ops::all_reduce(torch::ones({1}), ops::AllReduceOptions(), metrics);
    }
    std::cout << "rank " << rank << " finished" << std::endl;
    commgrad::destroy_process_group();
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << std::endl;
    return 1;
  }
  return 0;
}
