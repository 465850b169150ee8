// Crash safety with real processes: a rank SIGKILLed during a save (after
// its shard file, or rank 0 after the index but before the rename) leaves
// the previous step loadable, also at another world size; the next save
// removes the partial directory.

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <unistd.h>

namespace commgrad::testing {
namespace {

namespace fs = std::filesystem;

ProcessResult job(int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {launcher_path(), "-n", std::to_string(ranks),
                                   build_path("tests/checkpoint/checkpoint_crash_job")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, clean_env({{"COMMGRAD_TIMEOUT", "20"}}), std::chrono::seconds(60));
}

std::string latest(const fs::path& root) {
  std::ifstream in(root / "latest");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(CheckpointCrash, RankKilledMidSaveLeavesThePreviousStepLoadable) {
  const fs::path root = fs::temp_directory_path() / ("commgrad-ckpt-crash-" + std::to_string(::getpid()));
  fs::remove_all(root);

  auto r = job(2, {"save", root.string(), "5"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(latest(root), "step-00000005\n");

  // Rank 1 of 2 dies once its shard of step 10 is on disk.
  r = job(2, {"save", root.string(), "10", "1", "shard"});
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, ::testing::HasSubstr("rank 1 killing itself after"));
  EXPECT_EQ(latest(root), "step-00000005\n");
  EXPECT_FALSE(fs::exists(root / "step-00000010"));
  EXPECT_TRUE(fs::exists(root / ".step-00000010.partial" / "rank-00001.safetensors"));

  // Step 5 loads intact (at another world size: resharded too).
  r = job(3, {"load", root.string()});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int k = 0; k < 3; ++k) {
    EXPECT_THAT(r.out, ::testing::HasSubstr("rank " + std::to_string(k) + " loaded step 5 ok")) << r.out;
  }

  // Rank 0 dies after writing the index, before the rename.
  r = job(2, {"save", root.string(), "10", "0", "index"});
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(latest(root), "step-00000005\n");
  EXPECT_FALSE(fs::exists(root / "step-00000010"));
  EXPECT_TRUE(fs::exists(root / ".step-00000010.partial" / "index.json"));
  r = job(1, {"load", root.string()});
  EXPECT_THAT(r.out, ::testing::HasSubstr("rank 0 loaded step 5 ok")) << r.out << r.err;

  // A complete save cleans up and becomes the latest.
  r = job(2, {"save", root.string(), "10"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_FALSE(fs::exists(root / ".step-00000010.partial"));
  EXPECT_EQ(latest(root), "step-00000010\n");
  r = job(1, {"load", root.string()});
  EXPECT_THAT(r.out, ::testing::HasSubstr("rank 0 loaded step 10 ok")) << r.out << r.err;
  fs::remove_all(root);
}

}  // namespace
}  // namespace commgrad::testing
