// examples/gpt_train surviving failures under commgrad-run: rank 0 SIGKILLed
// at step 4 of 8 under --max-restarts 1 with --save-every 2, the job restarts
// from step 2 and ends with the final state of an uninterrupted run, bit for
// bit (the files of the final checkpoint are byte-identical); with no restarts
// left the job fails naming the rank and the reason. A preemption (SIGTERM to
// the launcher during step 5) saves the step and exits 75; a second SIGTERM
// during that save leaves the previous checkpoint the one that loads.

#include "harness/subprocess.h"
#include "harness/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

ProcessResult gpt_train(std::vector<std::string> launcher_args, std::vector<std::string> args,
                        const std::string& fault = "") {
  std::vector<std::string> cmd{launcher_path(), "-n", "2", "--timeout", "150", "--grace", "30"};
  cmd.insert(cmd.end(), launcher_args.begin(), launcher_args.end());
  cmd.push_back(build_path("bin/gpt_train"));
  cmd.insert(cmd.end(), args.begin(), args.end());
  return run_process(cmd, clean_env({{"GPT_TRAIN_FAULT", fault}}), std::chrono::seconds(170));
}

std::vector<std::string> train_args(const std::string& dir) {
  return {"--dp", "2", "--steps", "8", "--save", dir, "--save-every", "2", "--curve", "none"};
}

std::string contents(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every file of step `step` in `a` is byte-identical to the one in `b`.
void expect_same_step(const fs::path& a, const fs::path& b, const std::string& step) {
  ASSERT_TRUE(fs::exists(a / step / "index.json")) << a;
  int files = 0;
  for (const auto& e : fs::directory_iterator(a / step)) {
    const auto name = e.path().filename();
    EXPECT_EQ(contents(e.path()), contents(b / step / name)) << name << " differs";
    ++files;
  }
  EXPECT_EQ(files, 3);  // index.json and the two ranks' shards
}

TEST(GptTrainRestart, RankZeroKilledAtStepFourRestartsAndEndsBitForBitAsAnUninterruptedRun) {
  TempRoot straight("straight");
  TempRoot restarted("restarted");
  auto r = gpt_train({}, train_args(straight.str()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;

  r = gpt_train({"--max-restarts", "1"}, train_args(restarted.str()), "kill:4");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] fault: rank 0 kills itself (SIGKILL) as step 4 begins"));
  EXPECT_THAT(r.err, HasSubstr("commgrad-run: rank 0 (pid "));
  EXPECT_THAT(r.err, HasSubstr("was killed by signal SIGKILL (9)"));
  EXPECT_THAT(r.err, HasSubstr("commgrad-run: restarting the job (restart 1 of 1)"));
  EXPECT_THAT(r.out, HasSubstr("[0] resumed from step 2 of " + restarted.str()));
  EXPECT_THAT(r.out, HasSubstr("[0] saved step 8 in " + restarted.str()));
  expect_same_step(straight.path(), restarted.path(), "step-00000008");

  // Killed on every start: with no restarts left the job fails, naming the rank and the reason.
  TempRoot failing("failing");
  r = gpt_train({"--max-restarts", "1"}, train_args(failing.str()), "kill:4:2");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.out << r.err;
  const auto last = r.err.rfind("commgrad-run: rank 0 (pid ");
  ASSERT_NE(last, std::string::npos) << r.err;
  EXPECT_NE(r.err.find("was killed by signal SIGKILL (9)", last), std::string::npos) << r.err;
  EXPECT_THAT(r.err, HasSubstr("no restarts left (--max-restarts 1); the job failed"));
}

TEST(GptTrainRestart, PreemptionDuringStepFiveSavesTheStepAndASecondSignalKeepsThePreviousOne) {
  TempRoot root("preempt");
  auto r = gpt_train({}, train_args(root.str()), "preempt:5");
  EXPECT_EQ(r.exit_code, 75) << r.out << r.err;
  const std::regex preempted(R"(\[0\] preempted: saved step (\d+) in )");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, preempted)) << r.out << r.err;
  const int step = std::stoi(m[1]);
  EXPECT_TRUE(step == 5 || step == 6) << "the signal came during step 5; saved " << step;  // 6: it reached rank 0 late
  EXPECT_EQ(contents(root.path() / "latest"), "step-0000000" + std::to_string(step) + "\n");
  // It loads: the job continues from it to the end.
  r = gpt_train({}, train_args(root.str()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] resumed from step " + std::to_string(step)));

  // The second SIGTERM arrives as the save begins: the launcher kills the
  // ranks; step 4 (--save-every 2) stays the one that loads.
  TempRoot twice("preempt_twice");
  r = gpt_train({}, train_args(twice.str()), "preempt-twice:5");
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.exit_code, 75) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("while stopping; sending SIGKILL"));
  EXPECT_EQ(contents(twice.path() / "latest"), "step-00000004\n");
  r = gpt_train({}, train_args(twice.str()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] resumed from step 4"));
}

}  // namespace
}  // namespace commgrad::testing
