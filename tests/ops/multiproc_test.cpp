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
  EXPECT_NE(result.err.find("[0] [commgrad] all_reduce rank 0/2 group 'world' (gloo): the process is terminating ("),
            std::string::npos)
      << result.err;
  EXPECT_NE(result.err.find("while collective #0 had not completed"), std::string::npos) << result.err;
  EXPECT_NE(result.err.find("set COMMGRAD_DEBUG=1 on every rank"), std::string::npos) << result.err;
}

// An uncaught error that has nothing to do with communication, thrown after
// the last collective completed: the terminate handler blames no collective
// (it used to name the finished all_reduce) and the error itself is printed.
TEST(OpsMultiProcess, UncaughtErrorAfterACollectiveBlamesNoCollective) {
  auto result =
      testing::run_process({testing::launcher_path(), "-n", "2", "--timeout", "60",
                            testing::build_path("tests/ops/ops_check"), "--uncaught-error"},
                           testing::clean_env({{"COMMGRAD_BACKEND", "gloo"}, {"COMMGRAD_DEBUG", ""}}), seconds(90));
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.err.find("cannot be multiplied"), std::string::npos) << result.err;
  EXPECT_EQ(result.err.find("the process is terminating"), std::string::npos) << result.err;
  EXPECT_EQ(result.err.find("[commgrad] all_reduce"), std::string::npos) << result.err;
}

}  // namespace
}  // namespace commgrad::ops
