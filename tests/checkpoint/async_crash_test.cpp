// A rank SIGKILLed during a background save (AsyncSaver, after its shard
// file of step 2 is on disk, while the training thread runs collectives)
// leaves step 1 the one `latest` names, loadable.

#include "harness/subprocess.h"
#include "harness/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

namespace commgrad::testing {
namespace {

TEST(AsyncSaveCrash, RankKilledDuringABackgroundWriteLeavesThePreviousStepLoadable) {
  TempRoot root("async-crash");
  TempRoot traces("async-crash-traces");  // the failed job's flight records, removed with it
  const auto env = clean_env({{"COMMGRAD_TIMEOUT", "20"}, {"COMMGRAD_TRACE_DIR", traces.str()}});
  auto r = run_process(
      {launcher_path(), "-n", "2", build_path("tests/checkpoint/checkpoint_async_crash_job"), root.str(), "1"}, env,
      std::chrono::seconds(60));
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, ::testing::HasSubstr("rank 1 killing itself after"));
  std::ifstream in(root.path() / "latest");
  std::stringstream latest;
  latest << in.rdbuf();
  EXPECT_EQ(latest.str(), "step-00000001\n");

  r = run_process({launcher_path(), "-n", "2", build_path("tests/checkpoint/checkpoint_crash_job"), "load", root.str()},
                  env, std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int k = 0; k < 2; ++k) {
    EXPECT_THAT(r.out, ::testing::HasSubstr("rank " + std::to_string(k) + " loaded step 1 ok")) << r.out;
  }
}

}  // namespace
}  // namespace commgrad::testing
