// checkpoint::AsyncSaver on thread ranks: a background save writes the same
// files, byte for byte, as a synchronous save of the same state, although
// training changes the tensors while it runs; a save that fails during its
// background write fails on every rank and leaves the previous step the one
// `latest` names, loadable.

#include "checkpoint/checkpoint_util.h"
#include "harness/spawn_ranks.h"

#include <commgrad/checkpoint.h>
#include <commgrad/checkpoint/async_save.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <sstream>

namespace commgrad::testing {
namespace {

namespace fs = std::filesystem;

std::string file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Rank r's pieces: its rows of a [5, 3] float32 weight and a float64 bias every rank holds.
std::vector<checkpoint::TensorPiece> pieces_of(const Group& g) {
  return {row_piece("model/w", global_tensor({5, 3}, at::kFloat), 0, g.size(), g.rank()),
          checkpoint::TensorPiece::whole("model/b", global_tensor({4}, at::kDouble))};
}

TEST(AsyncSaveTest, WritesTheFilesASynchronousSaveWritesWhileTrainingChangesTheTensors) {
  TempRoot sync_root("sync");
  TempRoot async_root("async");
  std::string step_dir;  // the name of step 7's directory
  spawn_ranks(2, [&](Group& g) {
    checkpoint::AsyncSaver saver(g);
    auto pieces = pieces_of(g);
    const auto saved = checkpoint::save(sync_root.str(), 7, pieces, {{"epoch", 1}}, {}, g);
    if (g.rank() == 0) step_dir = fs::path(saved.directory).filename().string();
    saver.save(async_root.str(), 7, pieces, {{"epoch", 1}});
    for (auto& p : pieces) p.tensor.add_(1);  // the next training step, while the save runs
    const auto result = saver.wait();
    ASSERT_TRUE(result.has_value());
    EXPECT_EQ(result->step, 7);
    EXPECT_FALSE(saver.in_flight());
    EXPECT_FALSE(saver.wait().has_value());
  });
  const fs::path a = sync_root.path() / step_dir;
  const fs::path b = async_root.path() / step_dir;
  size_t files = 0;
  for (const auto& f : fs::directory_iterator(a)) {
    EXPECT_EQ(file_bytes(f.path()), file_bytes(b / f.path().filename())) << f.path().filename();
    ++files;
  }
  EXPECT_EQ(files, 3u);  // two shard files and the index
  EXPECT_EQ(file_bytes(sync_root.path() / "latest"), file_bytes(async_root.path() / "latest"));
}

TEST(AsyncSaveTest, FailureDuringTheBackgroundWriteKeepsThePreviousStep) {
  TempRoot root("fail");
  spawn_ranks(2, [&](Group& g) {
    checkpoint::AsyncSaver saver(g);
    auto pieces = pieces_of(g);
    saver.save(root.str(), 1, pieces);
    for (auto& p : pieces) p.tensor.add_(1);
    const int rank = g.rank();
    auto options = checkpoint::SaveOptions().on_file_written([rank](const std::string& path, int64_t) {
      if (rank == 1 && path.find("rank-") != std::string::npos) throw std::runtime_error("disk gone");
    });
    saver.save(root.str(), 2, pieces, nlohmann::json::object(), options);  // waits for step 1 first
    const std::string error = error_of([&] { saver.wait(); });
    EXPECT_THAT(error, ::testing::HasSubstr("disk gone")) << "rank " << rank;
    // `latest` still names step 1, which loads with step 1's values.
    auto dests = pieces_of(g);
    for (auto& d : dests) d.tensor.zero_();
    const auto loaded = checkpoint::load(root.str(), dests, {}, g);
    EXPECT_EQ(loaded.step, 1);
    const auto expected = pieces_of(g);
    for (size_t i = 0; i < dests.size(); ++i) EXPECT_TRUE(at::equal(dests[i].tensor, expected[i].tensor));
  });
}

}  // namespace
}  // namespace commgrad::testing
