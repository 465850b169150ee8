// examples/gpt_train under commgrad-run: the GPT trained TP x PP x DP
// follows the one-rank loss curve (the program checks itself with --check;
// bit for bit with pipelining alone), and the golden curve of the first
// steps is pinned here. Plus its errors.

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

struct Case {
  int ranks;
  std::vector<std::string> args;
  std::string name;
};
void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

class GptTrainExample : public ::testing::TestWithParam<Case> {};

TEST_P(GptTrainExample, FollowsTheOneRankCurve) {
  const auto& c = GetParam();
  std::vector<std::string> cmd{launcher_path(), "-n", std::to_string(c.ranks), "--timeout", "150",
                               build_path("bin/gpt_train"), "--check", "--steps", "4"};
  cmd.insert(cmd.end(), c.args.begin(), c.args.end());
  auto r = run_process(cmd, clean_env(), std::chrono::seconds(170));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // The golden curve: the one-rank losses of the first steps (float32).
  EXPECT_THAT(r.out, HasSubstr("(one rank 4.359748)"));
  EXPECT_THAT(r.out, HasSubstr("[0] step 2/4: loss 4.109256 (one rank 4.109256)"));
  EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-05): ok\n"));
  EXPECT_TRUE(lines_with_prefix(r.out, "[1] ").empty()) << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, GptTrainExample,
    ::testing::Values(Case{1, {}, "one_rank"}, Case{2, {"--pp", "2"}, "pp2"},
                      Case{4, {"--tp", "2", "--pp", "2", "--schedule", "gpipe"}, "tp2_pp2_gpipe"},
                      Case{4, {"--pp", "2", "--dp", "2", "--microbatches", "2"}, "pp2_dp2"},
                      Case{8, {"--tp", "2", "--pp", "2", "--dp", "2"}, "tp2_pp2_dp2"}),
    [](const auto& info) { return info.param.name; });

TEST(GptTrainExample, PipeliningAloneIsBitForBit) {
  auto r = run_process({launcher_path(), "-n", "4", "--timeout", "90", build_path("bin/gpt_train"), "--pp", "4",
                        "--check", "--steps", "3"},
                       clean_env(), std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("max relative difference from one rank 0 (tolerance"));
}

TEST(GptTrainExample, LayoutsThatDoNotFitAreErrors) {
  auto r = run_process({launcher_path(), "-n", "3", "--timeout", "60", build_path("bin/gpt_train"), "--pp", "3"},
                       clean_env(), std::chrono::seconds(90));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("gpt_train: 4 layers do not split into 3 stages"));
  r = run_process({launcher_path(), "-n", "2", "--timeout", "60", build_path("bin/gpt_train"), "--dp", "2",
                   "--microbatches", "8"},
                  clean_env(), std::chrono::seconds(90));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("does not split into 2 replicas x 8 microbatches"));
  r = run_process({launcher_path(), "-n", "2", "--timeout", "60", build_path("bin/gpt_train"), "--tp", "2", "--pp",
                   "2"},
                  clean_env(), std::chrono::seconds(90));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--tp 2 x --pp 2 x --dp 1 is not the world size 2"));
}

}  // namespace
}  // namespace commgrad::testing
