// The publish rules of checkpoint::save that a restarting job relies on: a
// failed save (a full disk) leaves no partial directory behind; keep(k)
// prunes before it writes, so the root needs room for k steps, never less
// than the newest; latest_complete_step() passes over a damaged newest step
// to the previous intact one and says what it skipped.

#include "checkpoint/checkpoint_util.h"
#include "harness/spawn_ranks.h"

#include <commgrad/checkpoint.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

namespace commgrad::testing {
namespace {

using checkpoint::TensorPiece;
using ::testing::HasSubstr;

std::vector<TensorPiece> pieces_of(float v, const Group& g) {
  return {row_piece("x", at::full({6}, v), 0, g.size(), g.rank()), TensorPiece::whole("r", at::full({2}, v))};
}

bool any_partial(const fs::path& root) {
  for (const auto& e : fs::directory_iterator(root)) {
    if (e.path().filename().string().rfind(".step-", 0) == 0) return true;
  }
  return false;
}

TEST(CheckpointPublish, AFullDiskLeavesNoPartialDirectoryAndThePreviousStepLoads) {
  TempRoot root("enospc");
  spawn_ranks(2, [&](Group& g) {
    checkpoint::save(root.str(), 2, pieces_of(2, g), {}, {}, g);
    // Rank 1's shard does not fit: the write fails as ENOSPC does.
    auto full = checkpoint::SaveOptions().on_file_written([&](const std::string& path, int64_t) {
      if (g.rank() == 1 && path.find(".safetensors") != std::string::npos) {
        throw std::runtime_error("cannot write " + path + ": No space left on device");
      }
    });
    expect_error([&] { checkpoint::save(root.str(), 4, pieces_of(4, g), {}, full, g); },
                 {"checkpoint::save rank ", g.rank() == 1 ? "No space left on device" : "rank 1 failed: "});
    if (g.rank() == 0) {
      EXPECT_FALSE(any_partial(root.path())) << "the failed save left its partial directory";
      EXPECT_EQ(checkpoint::latest_step(root.str()), 2);
    }
    auto d = pieces_of(0, g);
    EXPECT_EQ(checkpoint::load(root.str(), d, {}, g).step, 2);
    EXPECT_TRUE(at::equal(d[1].tensor, at::full({2}, 2.0f)));
  });
}

TEST(CheckpointPublish, KeepPrunesBeforeWritingSoItNeedsRoomForKeepSteps) {
  TempRoot root("keep");
  spawn_ranks(2, [&](Group& g) {
    const auto keep2 = checkpoint::SaveOptions().keep(2);
    for (int64_t step : {1, 2}) checkpoint::save(root.str(), step, pieces_of(float(step), g), {}, keep2, g);
    // While step 3 is written, only step 2 is left beside it: 2 steps on disk, not 3.
    std::vector<int64_t> seen;
    auto watch = checkpoint::SaveOptions().keep(2).on_file_written([&](const std::string& path, int64_t) {
      if (path.find(".safetensors") != std::string::npos) seen = checkpoint::saved_steps(root.str());
    });
    checkpoint::save(root.str(), 3, pieces_of(3, g), {}, watch, g);
    EXPECT_EQ(seen, (std::vector<int64_t>{2}));
    EXPECT_EQ(checkpoint::saved_steps(root.str()), (std::vector<int64_t>{2, 3}));

    // keep(1) never prunes the newest before writing: a failed save leaves it.
    auto keep1_fails = checkpoint::SaveOptions().keep(1).on_file_written([&](const std::string& path, int64_t) {
      if (path.find(".safetensors") != std::string::npos) throw std::runtime_error("disk full");
    });
    expect_error([&] { checkpoint::save(root.str(), 4, pieces_of(4, g), {}, keep1_fails, g); }, {"disk full"});
    EXPECT_EQ(checkpoint::saved_steps(root.str()), (std::vector<int64_t>{3}));
    auto d = pieces_of(0, g);
    EXPECT_EQ(checkpoint::load(root.str(), d, {}, g).step, 3);
    checkpoint::save(root.str(), 5, pieces_of(5, g), {}, checkpoint::SaveOptions().keep(1), g);
    EXPECT_EQ(checkpoint::saved_steps(root.str()), (std::vector<int64_t>{5}));
  });
}

TEST(CheckpointPublish, LatestCompleteStepFallsBackPastADamagedNewestStep) {
  TempRoot root("fallback");
  spawn_ranks(2, [&](Group& g) {
    for (int64_t step : {2, 4, 6}) checkpoint::save(root.str(), step, pieces_of(float(step), g), {}, {}, g);
  });
  auto found = checkpoint::latest_complete_step(root.str());
  EXPECT_EQ(found.step, 6);
  EXPECT_TRUE(found.skipped.empty());

  // The newest step's second shard loses its tail; step 4's index is garbage.
  fs::resize_file(root.path() / "step-00000006" / "rank-00001.safetensors", 10);
  std::ofstream(root.path() / "step-00000004" / "index.json") << "{ not json";
  ::testing::internal::CaptureStderr();
  found = checkpoint::latest_complete_step(root.str());
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(found.step, 2);
  ASSERT_EQ(found.skipped.size(), 2u);
  EXPECT_THAT(found.skipped[0], HasSubstr("step-00000006: rank-00001.safetensors has 10 bytes, the index records "));
  EXPECT_THAT(found.skipped[1], HasSubstr("step-00000004: its index does not parse"));
  EXPECT_THAT(warned, HasSubstr(": skipped step-00000006: rank-00001.safetensors has 10 bytes"));
  EXPECT_THAT(warned, HasSubstr("resuming from step 2"));
  spawn_ranks(1, [&](Group& g) {
    auto d = pieces_of(0, g);
    EXPECT_EQ(checkpoint::load(root.str(), d, checkpoint::LoadOptions().step(*found.step), g).step, 2);
    EXPECT_TRUE(at::equal(d[0].tensor, at::full({6}, 2.0f)));
  });

  // `latest` names a step that is not there (a mutated publish order): the newest intact one below it.
  std::ofstream(root.path() / "latest") << "step-00000008\n";
  found = checkpoint::latest_complete_step(root.str());
  EXPECT_EQ(found.step, 2);
  EXPECT_THAT(found.skipped[0], HasSubstr("step-00000008: it has no index.json"));
  fs::remove_all(root.path());
  fs::create_directories(root.path());
  EXPECT_FALSE(checkpoint::latest_complete_step(root.str()).step.has_value());
}

}  // namespace
}  // namespace commgrad::testing
