// ops_check (a small program exercising the collectives and checking the
// results in closed form) under commgrad-run, as separate processes at 2 and
// 3 ranks, and the debug check failing every rank of a real job.

#include "harness/subprocess.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

namespace commgrad::ops {
namespace {

using std::chrono::seconds;

// ~~~ multi-process, through commgrad-run ~~~

TEST(OpsMultiProcess, OpsCheckUnderLauncher) {
  for (int n : {2, 3}) {
    auto result = testing::run_process({testing::launcher_path(), "-n", std::to_string(n), "--timeout", "60",
                                        testing::build_path("tests/ops/ops_check")},
                                       {}, seconds(90));
    EXPECT_EQ(result.exit_code, 0) << "n=" << n << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err;
    EXPECT_NE(result.out.find("ops_check: all checks passed on " + std::to_string(n) + " ranks"), std::string::npos)
        << result.out;
  }
}

TEST(OpsMultiProcess, DebugMismatchFailsEveryRank) {
  auto result = testing::run_process({testing::launcher_path(), "-n", "2", "--timeout", "60",
                                      testing::build_path("tests/ops/ops_check"), "--mismatch"},
                                     {{"COMMGRAD_DEBUG", "1"}}, seconds(90));
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.err.find("[0] "), std::string::npos) << result.err;
  EXPECT_NE(result.err.find("ranks disagree on collective"), std::string::npos) << result.err;
}

// Without the debug check, a rank that receives more than it posted is
// aborted by Gloo's I/O thread (nothing can catch it); the process still
// says which collective was in flight and what to do.
TEST(OpsMultiProcess, GlooAbortOnASizeMismatchNamesTheCollective) {
  auto result =
      testing::run_process({testing::launcher_path(), "-n", "2", "--timeout", "60",
                            testing::build_path("tests/ops/ops_check"), "--mismatch", "1000", "2000"},
                           testing::clean_env({{"COMMGRAD_BACKEND", "gloo"}, {"COMMGRAD_DEBUG", ""}}), seconds(90));
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.err.find("[commgrad] all_reduce rank 0/2 group 'world' (gloo): the process is terminating ("),
            std::string::npos)
      << result.err;
  EXPECT_NE(result.err.find("while collective #0 had not completed"), std::string::npos) << result.err;
  EXPECT_NE(result.err.find("set COMMGRAD_DEBUG=1 on every rank"), std::string::npos) << result.err;
}

// An uncaught error that has nothing to do with communication, thrown after
// the last collective completed, on each of 4 ranks: the terminate handler
// blames no collective (it used to name the finished all_reduce), and the
// job prints the error once (the ranks leave it in their error files, the
// launcher reports it with the ranks it came from), without LibTorch's
// backtrace; the ranks exit with status 1. COMMGRAD_BACKTRACE=1 brings the
// backtrace back.
size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(OpsMultiProcess, UncaughtErrorOnEveryRankIsPrintedOnceWithoutBacktrace) {
  const auto run = [](const char* backtrace) {
    return testing::run_process(
        {testing::launcher_path(), "-n", "4", "--timeout", "60", testing::build_path("tests/ops/ops_check"),
         "--uncaught-error"},
        testing::clean_env({{"COMMGRAD_BACKEND", "gloo"}, {"COMMGRAD_DEBUG", ""}, {"COMMGRAD_BACKTRACE", backtrace}}),
        seconds(90));
  };
  const auto result = run("");
  EXPECT_NE(result.exit_code, 0);
  const std::string all = result.out + result.err;
  EXPECT_EQ(count(all, "cannot be multiplied"), 1u) << all;
  EXPECT_NE(result.err.find("exited with code 1"), std::string::npos) << result.err;
  EXPECT_NE(result.err.find("commgrad-run: error on rank "), std::string::npos) << result.err;
  EXPECT_NE(result.err.find(" (the first to fail), and alike on ranks "), std::string::npos) << result.err;
  EXPECT_NE(result.err.find(": c10::Error: "), std::string::npos) << result.err;
  EXPECT_EQ(all.find("Exception raised from"), std::string::npos) << all;
  EXPECT_EQ(all.find("terminate called"), std::string::npos) << all;
  EXPECT_EQ(all.find("the process is terminating"), std::string::npos) << all;
  EXPECT_EQ(all.find("[commgrad] all_reduce"), std::string::npos) << all;

  const auto traced = run("1");
  EXPECT_NE(traced.err.find("Exception raised from"), std::string::npos) << traced.err;
}

}  // namespace
}  // namespace commgrad::ops
