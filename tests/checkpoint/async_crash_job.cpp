// checkpoint::AsyncSaver under commgrad-run (one process per rank, Gloo), for
// async_crash_test:
//
//   checkpoint_async_crash_job ROOT KILL_RANK
//       saves step 1 in the background and waits for it, then starts step 2
//       in the background and trains on (a loop of small all_reduces on the
//       world) while it is written; rank KILL_RANK SIGKILLs itself from the
//       saver's thread once its shard file of step 2 is on disk. The tensors
//       are checkpoint_crash_job's ("x": 100 * STEP + i split over the ranks,
//       "r" replicated), so `checkpoint_crash_job load ROOT` checks what stays.

#include <commgrad/commgrad.h>

#include <ATen/ATen.h>

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>

#include <unistd.h>

namespace {

namespace ckpt = commgrad::checkpoint;
constexpr int64_t kLength = 12;

std::vector<ckpt::TensorPiece> pieces_of(const commgrad::Group& world, int64_t step) {
  const int n = world.size();
  const int64_t begin = kLength * world.rank() / n;
  const int64_t end = kLength * (world.rank() + 1) / n;
  const at::Tensor x = at::arange(kLength, at::kFloat) + 100.0f * static_cast<float>(step);
  auto p = ckpt::TensorPiece::whole(std::string("x"), x.narrow(0, begin, end - begin).clone());
  p.global_shape = {kLength};
  p.box_offset = {begin};
  p.box_shape = {end - begin};
  return {p, ckpt::TensorPiece::whole("r", at::full({3}, step, at::kLong))};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: checkpoint_async_crash_job ROOT KILL_RANK\n";
    return 2;
  }
  const std::string root = argv[1];
  const int kill_rank = std::atoi(argv[2]);
  auto world = commgrad::init_process_group(commgrad::InitOptions().backend("gloo"));
  ckpt::AsyncSaver saver(world);
  saver.save(root, 1, pieces_of(world, 1));
  saver.wait();
  auto options = ckpt::SaveOptions().on_file_written([&](const std::string& path, int64_t) {
    if (world.rank() == kill_rank && path.find(".safetensors") != std::string::npos) {
      std::cout << "rank " << world.rank() << " killing itself after " << path << std::endl;
      ::kill(::getpid(), SIGKILL);
    }
  });
  saver.save(root, 2, pieces_of(world, 2), nlohmann::json::object(), options);
  for (int step = 0; step < 50; ++step) commgrad::ops::all_reduce(at::ones({4}));  // training goes on
  saver.wait();
  std::cout << "rank " << world.rank() << " saved step 2" << std::endl;
  commgrad::destroy_process_group();
  return 0;
}
