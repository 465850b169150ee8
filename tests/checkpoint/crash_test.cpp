// Crash safety with real processes: a rank SIGKILLed during a save (after
// its shard file, or rank 0 after the index but before the rename) leaves
// the previous step loadable, also at another world size; the next save
// removes the partial directory. And a kill after every step of the publish
// sequence leaves `latest` naming a complete step that loads (a publish that
// replaced `latest` before the rename would fail it).

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

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
  // (rank 0 may have removed the partial directory when the save failed under it)

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

// The step directory `latest` names holds its index (the step is complete).
bool latest_is_complete(const fs::path& root) {
  std::string name = latest(root);
  if (!name.empty() && name.back() == '\n') name.pop_back();
  return !name.empty() && fs::exists(root / name / "index.json");
}

TEST(CheckpointCrash, AKillAfterEveryPublishStepLeavesLatestNamingAStepThatLoads) {
  const fs::path root = fs::temp_directory_path() / ("commgrad-ckpt-publish-" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto r = job(1, {"save", root.string(), "1"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  int64_t step = 1;
  // Before the rename the previous step stays the latest; from `latest` on, the new one.
  const std::vector<std::pair<std::string, bool>> points = {
      {"index", false}, {"renamed", false}, {"latest.tmp", false}, {"latest", true}, {"pruned", true}};
  for (const auto& [point, publishes] : points) {
    SCOPED_TRACE("killed after " + point);
    r = job(1, {"save", root.string(), std::to_string(step + 1), "0", point});
    EXPECT_NE(r.exit_code, 0) << r.out << r.err;
    EXPECT_THAT(r.out, ::testing::HasSubstr("rank 0 killing itself after " + point)) << r.out << r.err;
    EXPECT_TRUE(latest_is_complete(root)) << "latest holds '" << latest(root) << "'";
    if (publishes) ++step;
    char expected[32];
    std::snprintf(expected, sizeof(expected), "step-%08lld\n", static_cast<long long>(step));
    EXPECT_EQ(latest(root), expected);
    r = job(1, {"load", root.string()});
    EXPECT_THAT(r.out, ::testing::HasSubstr("rank 0 loaded step " + std::to_string(step) + " ok")) << r.out << r.err;
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace commgrad::testing
