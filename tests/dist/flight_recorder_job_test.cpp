// A job made to hang under commgrad-run (flight_recorder_job, 3 ranks, group
// timeout 3 s): the launcher finds the ranks' flight records and prints
// commgrad-trace's diagnosis, which names the rank at fault, the collective
// it is in and the collective the others wait in.

#include "harness/subprocess.h"
#include "harness/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

ProcessResult run_job(const std::string& mode, const std::map<std::string, std::string>& env) {
  return run_process({launcher_path(), "-n", "3", "--timeout", "60", build_path("tests/dist/flight_recorder_job"), mode,
                      "1", "--timeout", "3"},
                     clean_env(env), std::chrono::seconds(90));
}

TEST(FlightRecorderJobTest, RankThatSkipsAnAllReduceIsNamedWithWhereItIs) {
  TempRoot dir("records");
  const auto result = run_job("--skip", {{"COMMGRAD_TRACE_DIR", dir.str()}});
  const std::string all = result.out + result.err;
  EXPECT_NE(result.exit_code, 0) << all;
  EXPECT_LT(result.seconds, 30) << all;  // ended by the 3 s group timeout
  EXPECT_THAT(result.err, HasSubstr("commgrad-run: flight records of the ranks are in " + dir.str())) << all;
  EXPECT_THAT(result.err, HasSubstr("group 'world' (ranks [0, 1, 2]) is stuck at collective #1:")) << all;
  EXPECT_THAT(result.err, HasSubstr("rank 1 is behind on group 'world': ranks [0, 2] wait in all_reduce #1 "
                                    "float32[8], which rank 1 never called; it is in all_reduce #1 float32[1] on "
                                    "group 'metrics'"))
      << all;
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(std::filesystem::exists(dir.path() / ("rank_" + std::to_string(r) + ".json")));
}

TEST(FlightRecorderJobTest, RankThatCallsAnotherCollectiveIsNamed) {
  const auto result = run_job("--mismatch", {});
  const std::string all = result.out + result.err;
  EXPECT_NE(result.exit_code, 0) << all;
  EXPECT_THAT(result.err, HasSubstr("rank 1 called all_gather #1 float32[8] on group 'world' where ranks [0, 2] call "
                                    "all_reduce #1 float32[8]"))
      << all;
  // The launcher made the directory (under TMPDIR); it keeps the records.
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.err, match, std::regex("flight records of the ranks are in (\\S+);"))) << all;
  const std::filesystem::path dir = match[1].str();
  EXPECT_TRUE(std::filesystem::exists(dir / "rank_1.json")) << dir;
  std::filesystem::remove_all(dir);
}

// A job that succeeds leaves no directory behind.
TEST(FlightRecorderJobTest, SuccessfulJobLeavesNoRecords) {
  TempRoot tmp("tmpdir");
  std::filesystem::create_directories(tmp.path());
  const auto result = run_process({launcher_path(), "-n", "2", build_path("tests/dist/flight_recorder_job")},
                                  clean_env({{"TMPDIR", tmp.str()}}), std::chrono::seconds(90));
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  EXPECT_THAT(result.out, HasSubstr("rank 1 finished"));
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));
}

}  // namespace
}  // namespace commgrad::testing
