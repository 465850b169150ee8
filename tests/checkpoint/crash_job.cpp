// A small checkpointing program for checkpoint_crash_test (started by
// commgrad-run, one process per rank, Gloo):
//
//   checkpoint_crash_job save ROOT STEP [KILL_RANK shard|index|renamed|latest.tmp|latest|pruned]
//       saves "x" (float32 [12], split over the ranks; element i holds
//       100 * STEP + i) and "r" (int64 [3], replicated) as step STEP, keeping
//       2 steps; with KILL_RANK, that rank SIGKILLs itself once its shard
//       file is on disk (shard) or, on rank 0, at that step of the publish
//       sequence (SaveOptions::on_publish: index is before the rename)
//   checkpoint_crash_job load ROOT
//       loads the latest step at this world size and prints
//       "rank r loaded step S ok" when every element is what that step saved
//
// Exit status 0 on success, 1 on a mismatch; a killed rank fails the job.

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

ckpt::TensorPiece x_piece(const commgrad::Group& world, const at::Tensor& full) {
  const int n = world.size();
  const int64_t begin = kLength * world.rank() / n;
  const int64_t end = kLength * (world.rank() + 1) / n;
  auto p = ckpt::TensorPiece::whole(std::string("x"), full.narrow(0, begin, end - begin));
  p.global_shape = {kLength};
  p.box_offset = {begin};
  p.box_shape = {end - begin};
  return p;
}

at::Tensor expected_x(int64_t step) { return at::arange(kLength, at::kFloat) + 100.0f * static_cast<float>(step); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: checkpoint_crash_job save ROOT STEP [KILL_RANK shard|index] | load ROOT\n";
    return 2;
  }
  const std::string mode = argv[1];
  const std::string root = argv[2];
  auto world = commgrad::init_process_group(commgrad::InitOptions().backend("gloo"));
  int status = 0;
  if (mode == "save") {
    const int64_t step = std::atoll(argv[3]);
    const int kill_rank = argc > 4 ? std::atoi(argv[4]) : -1;
    const std::string kill_at = argc > 5 ? argv[5] : "shard";
    const at::Tensor x = expected_x(step);
    std::vector<ckpt::TensorPiece> pieces = {x_piece(world, x),
                                             ckpt::TensorPiece::whole("r", at::full({3}, step, at::kLong))};
    auto die = [&](const std::string& where) {
      std::cout << "rank " << world.rank() << " killing itself after " << where << std::endl;
      ::kill(::getpid(), SIGKILL);
    };
    auto options =
        ckpt::SaveOptions()
            .keep(2)
            .on_file_written([&](const std::string& path, int64_t) {
              if (world.rank() == kill_rank && kill_at == "shard" && path.find(".safetensors") != std::string::npos) {
                die(path);
              }
            })
            .on_publish([&](const std::string& step_done) {
              if (world.rank() == kill_rank && kill_at == step_done) die(step_done);
            });
    ckpt::save(root, step, pieces, {{"mode", "crash_job"}}, options, world);
    std::cout << "rank " << world.rank() << " saved step " << step << std::endl;
  } else if (mode == "load") {
    at::Tensor x = at::zeros({kLength});
    at::Tensor r = at::zeros({3}, at::kLong);
    const auto result = ckpt::load(root, {x_piece(world, x), ckpt::TensorPiece::whole("r", r)}, {}, world);
    const auto piece = x_piece(world, expected_x(result.step));
    const bool ok =
        at::equal(x_piece(world, x).tensor, piece.tensor) && at::equal(r, at::full({3}, result.step, at::kLong));
    std::cout << "rank " << world.rank() << " loaded step " << result.step << (ok ? " ok" : " MISMATCH") << std::endl;
    status = ok ? 0 : 1;
  } else {
    std::cerr << "unknown mode " << mode << "\n";
    status = 2;
  }
  commgrad::destroy_process_group();
  return status;
}
