// examples/megatron_ffn as real processes under commgrad-run: the parallel
// FFN checked against its one-rank reference over real Gloo between
// processes (the thread harness covers the layers; this covers the launch).

#include "harness/command_line.h"
#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

TEST(MegatronFfnExample, TwoRanksUnderCommgradRun) {
  auto r = run_process({launcher_path(), "-n", "2", "--timeout", "120", build_path("bin/megatron_ffn")}, clean_env(),
                       std::chrono::seconds(150));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] Megatron FFN on 2 tensor-parallel ranks"));
  EXPECT_THAT(r.out, HasSubstr("[0] BLAS: "));
  EXPECT_THAT(r.out, HasSubstr("[0] commgrad::check ParallelMLP(hidden=64, ffn=256) tp=2 float32"));
  EXPECT_THAT(r.out, HasSubstr("[0] commgrad::check ParallelMLP(hidden=64, ffn=256) sequence-parallel tp=2 float32"));
  EXPECT_THAT(r.out, HasSubstr("[0] commgrad::check ParallelMLP(hidden=64, ffn=256) tp=2 float64"));
  for (const char* row :
       {"output", "input.grad", "fc1.weight.grad", "fc1.bias.grad", "fc2.weight.grad", "fc2.bias.grad"}) {
    EXPECT_THAT(r.out, HasSubstr(std::string("[0]   ") + row + " ")) << row;
  }
  EXPECT_EQ(lines_with_prefix(r.out, "[0]   all 11 tensors match").size(), 3u) << r.out;
  EXPECT_THAT(r.out, HasSubstr("[0] megatron_ffn: TP=2 matches TP=1"));
}

TEST(MegatronFfnExample, RunsAloneAsOneRank) {
  auto r = run_process({build_path("bin/megatron_ffn")}, clean_env(), std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("megatron_ffn: TP=1 matches TP=1"));
}

// Every option in --help; each bad one named, exit code 2, before any rank starts.
TEST(MegatronFfnExample, BadOptionsAreNamedBeforeAnyRankStarts) {
  const std::string program = build_path("bin/megatron_ffn");
  expect_help_lists(program, {"--device"});
  expect_bad_options(program, {
                                  {{"--bogus"}, "unknown option '--bogus'"},
                                  {{"extra"}, "unexpected argument 'extra'"},
                                  {{"--device", "gpu"}, "--device: expected one of cpu, cuda, got 'gpu'"},
                                  {{"--device"}, "--device: 1 required"},
                              });
}

}  // namespace
}  // namespace commgrad::testing
