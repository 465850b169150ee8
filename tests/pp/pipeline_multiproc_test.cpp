// Pipelines of real processes under commgrad-run: every schedule trains as
// the whole model does on each rank; a rank that dies mid-schedule ends the
// others within the timeout, with a message naming the stage, the
// microbatch and the rank that died.

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

std::string job() { return build_path("tests/pp/pipeline_job"); }

TEST(PipelineProcesses, EverySchedule) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"gpipe", "3"}, {"1f1b", "5"}, {"interleaved", "3", "2"}, {"zbh1", "4"}}) {
    std::vector<std::string> cmd{launcher_path(), "-n", "3", "--timeout", "60", job(), "train"};
    cmd.insert(cmd.end(), args.begin(), args.end());
    auto r = run_process(cmd, clean_env(), std::chrono::seconds(90));
    EXPECT_EQ(r.exit_code, 0) << args[0] << "\n" << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("[0] step 2: loss ")) << args[0];
    EXPECT_THAT(r.out, HasSubstr("[0] ok")) << args[0];
  }
}

TEST(PipelineProcesses, ARankThatDiesMidScheduleIsNamedByTheOthers) {
  auto r = run_process({launcher_path(), "-n", "3", "--grace", "15", "--timeout", "60", job(), "kill", "1f1b", "4"},
                       clean_env(), std::chrono::seconds(90));
  EXPECT_NE(r.exit_code, 0);
  // Rank 0 waits for stage 1's gradient, rank 2 for its activation.
  EXPECT_THAT(r.err, HasSubstr("[0] pipeline_job: [commgrad] Pipeline rank 0/3 group 'world' (shm): stage 0 microbatch "
                               "0 (recvG0.0) failed: "))
      << r.err;
  EXPECT_THAT(r.err, HasSubstr("[2] pipeline_job: [commgrad] Pipeline rank 2/3 group 'world' (shm): stage 2 microbatch "
                               "1 (recvA2.1) failed: "))
      << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid ")) << r.err;
}

}  // namespace
}  // namespace commgrad::testing
