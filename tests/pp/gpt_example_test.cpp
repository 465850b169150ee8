// examples/gpt_train under commgrad-run: the GPT (tied embeddings) trained
// TP x PP x DP (+SP, the interleaved and zero-bubble schedules; CP) follows the one-rank loss
// curve (the program checks itself with --check, relative 1e-5), and the
// golden curve of the first steps is pinned here. Save and resume under
// another layout continue the curve (bit for bit under the same layout);
// the progress lines, the loss curve files, a text corpus, and the errors.

#include "harness/command_line.h"
#include "harness/subprocess.h"
#include "harness/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

struct Case {
  int ranks;
  std::vector<std::string> args;
  std::string name;
};
void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

// `env`: variables on top of clean_env(); a non-empty `fault` sets GPT_TRAIN_FAULT.
ProcessResult gpt_train(int ranks, std::vector<std::string> args, const std::string& fault = "",
                        std::map<std::string, std::string> env = {}) {
  std::vector<std::string> cmd{launcher_path(), "-n",  std::to_string(ranks),
                               "--timeout",     "150", build_path("bin/gpt_train")};
  cmd.insert(cmd.end(), args.begin(), args.end());
  if (!fault.empty()) env["GPT_TRAIN_FAULT"] = fault;
  return run_process(cmd, clean_env(env), std::chrono::seconds(170));
}

// "step k/N: loss X" of each progress line, by step.
std::map<int, std::string> progress_losses(const std::string& out) {
  std::map<int, std::string> losses;
  const std::regex line(R"(\[0\] step (\d+)/\d+: loss ([0-9.]+), [0-9]+ tokens/s, ETA [0-9]+ s)");
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
    losses[std::stoi((*it)[1])] = (*it)[2];
  }
  return losses;
}

class GptTrainExample : public ::testing::TestWithParam<Case> {};

TEST_P(GptTrainExample, FollowsTheOneRankCurve) {
  const auto& c = GetParam();
  std::vector<std::string> args{"--check", "--steps", "4", "--curve", "none"};
  args.insert(args.end(), c.args.begin(), c.args.end());
  auto r = gpt_train(c.ranks, args);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // The golden curve: the one-rank losses of the first steps (float32). The
  // reference is split into the layout's microbatches, so its sums (and the
  // 7th digit: 4.6157064 at 2 microbatches, 4.6157070 at 4) follow them.
  EXPECT_THAT(r.out, HasSubstr("[0] check step 1/4: loss 4.84335"));
  EXPECT_THAT(r.out, HasSubstr("(one rank 4.84335"));
  EXPECT_THAT(r.out, HasSubstr("(one rank 4.61570"));
  EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-05): ok\n"));
  EXPECT_EQ(progress_losses(r.out).size(), 4u) << r.out;
  EXPECT_TRUE(lines_with_prefix(r.out, "[1] ").empty()) << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, GptTrainExample,
    ::testing::Values(
        Case{1, {}, "one_rank"}, Case{2, {"--pp", "2"}, "pp2"},
        Case{4, {"--pp", "4"}, "pp4_tied_over_an_embedding_group"},
        Case{4, {"--tp", "2", "--pp", "2", "--schedule", "gpipe"}, "tp2_pp2_gpipe"},
        Case{4, {"--tp", "2", "--pp", "2", "--sp"}, "tp2_pp2_sp"},
        Case{4, {"--pp", "2", "--dp", "2", "--microbatches", "2"}, "pp2_dp2"},
        Case{2, {"--pp", "2", "--schedule", "interleaved"}, "pp2_interleaved"},
        Case{4, {"--tp", "2", "--pp", "2", "--sp", "--schedule", "interleaved"}, "tp2_pp2_sp_interleaved"},
        Case{8, {"--tp", "2", "--pp", "2", "--dp", "2", "--sp"}, "tp2_pp2_dp2_sp"},
        Case{4, {"--pp", "2", "--dp", "2", "--schedule", "zbh1"}, "pp2_dp2_zero_bubble"},
        Case{4, {"--tp", "2", "--pp", "2", "--sp", "--schedule", "zbh1"}, "tp2_pp2_sp_zero_bubble"},
        Case{4, {"--tp", "2", "--dp", "2", "--sp", "--fsdp"}, "tp2_dp2_sp_fsdp"},
        Case{4, {"--pp", "2", "--dp", "2", "--schedule", "interleaved", "--fsdp"}, "pp2_dp2_interleaved_fsdp"},
        Case{8, {"--tp", "2", "--pp", "2", "--dp", "2", "--fsdp"}, "tp2_pp2_dp2_fsdp"},
        Case{4, {"--pp", "2", "--dp", "2", "--schedule", "zbh1", "--fsdp"}, "pp2_dp2_zero_bubble_fsdp"},
        Case{4, {"--tp", "2", "--dp", "2", "--sp", "--recompute", "full"}, "tp2_dp2_sp_recompute_full"},
        Case{4,
             {"--tp", "2", "--pp", "2", "--sp", "--schedule", "interleaved", "--recompute", "full"},
             "tp2_pp2_sp_interleaved_recompute_full"},
        Case{4,
             {"--tp", "2", "--pp", "2", "--sp", "--schedule", "zbh1", "--recompute", "selective"},
             "tp2_pp2_sp_zero_bubble_recompute_selective"},
        Case{4, {"--tp", "2", "--dp", "2", "--fsdp", "--recompute", "full"}, "tp2_dp2_fsdp_recompute_full"},
        // Context parallelism: the logged loss is the one-rank loss (not 1/CP of it).
        Case{2, {"--cp", "2"}, "cp2_ring"},
        Case{4, {"--cp", "2", "--tp", "2", "--sp", "--cp-mode", "allgather"}, "cp2_tp2_sp_allgather"},
        Case{4, {"--cp", "2", "--dp", "2", "--cp-mode", "ulysses"}, "cp2_dp2_ulysses"}),
    [](const auto& info) { return info.param.name; });

// A check must be shown to fail: GPT_TRAIN_FAULT=grad-scale:F multiplies
// every gradient of the parallel run by F after its reductions and before
// clipping (the reference is untouched), and --check must then fail, naming
// the parameter whose gradient is furthest off, for F = 2 and 0.5 under
// every layout; grad-scale:F:NAME scales one parameter's alone, and --check
// names that one. (The losses alone would not see it: AdamW hardly moves
// when a gradient is off by a constant factor, and clipping removes one.)
class GptTrainCheckFails : public ::testing::TestWithParam<Case> {};

TEST_P(GptTrainCheckFails, WhenTheGradientsAreScaled) {
#ifdef COMMGRAD_DEFAULT_LINE_ONLY
  GTEST_SKIP() << "the LibTorch 1.13 line adds nothing to this case (CI time)";
#endif
  const auto& c = GetParam();
  std::vector<std::string> args{"--check", "--steps", "2", "--curve", "none"};
  args.insert(args.end(), c.args.begin(), c.args.end());
  const std::regex named(R"(\[0\] gradients of step 1 \(before clipping\): \d+ tensors, the worst '[a-z0-9_.]+' )"
                         R"(off by [0-9.e+-]+ of its largest element \(tolerance [0-9.e+-]+\): MISMATCH\n)");
  for (const char* fault : {"grad-scale:2", "grad-scale:0.5"}) {
    auto r = gpt_train(c.ranks, args, fault);
    EXPECT_EQ(r.exit_code, 1) << fault << "\n" << r.out << r.err;
    EXPECT_TRUE(std::regex_search(r.out, named)) << fault << "\n" << r.out;
    EXPECT_THAT(r.out, HasSubstr("gradient norms: max relative difference")) << fault;
  }
  auto one = gpt_train(c.ranks, args, "grad-scale:2:layer2.attention.dense.bias");
  EXPECT_EQ(one.exit_code, 1) << one.out << one.err;
  EXPECT_THAT(one.out, HasSubstr("the worst 'layer2.attention.dense.bias' off by "));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, GptTrainCheckFails,
    ::testing::Values(Case{4, {"--tp", "2", "--dp", "2", "--fsdp"}, "tp2_dp2_fsdp"},
                      Case{4, {"--pp", "2", "--dp", "2"}, "pp2_dp2"},
                      Case{2, {"--pp", "2", "--schedule", "interleaved"}, "pp2_interleaved"},
                      Case{4, {"--tp", "2", "--pp", "2", "--schedule", "gpipe"}, "tp2_pp2_gpipe"},
                      Case{4, {"--pp", "2", "--dp", "2", "--schedule", "zbh1"}, "pp2_dp2_zero_bubble"},
                      Case{2, {"--cp", "2", "--cp-mode", "ring"}, "cp2_ring"},
                      Case{2, {"--cp", "2", "--cp-mode", "allgather"}, "cp2_allgather"},
                      Case{2, {"--cp", "2", "--cp-mode", "ulysses"}, "cp2_ulysses"},
                      Case{2, {"--experts", "4", "--dp", "2", "--ep", "2"}, "ep2_4_experts"},
                      Case{2, {"--tp", "2", "--sp", "--recompute", "full"}, "tp2_sp_recompute_full"},
                      Case{4, {"--tp", "2", "--dp", "2", "--fsdp", "--precision", "bf16"}, "tp2_dp2_fsdp_bf16"},
                      Case{2, {"--dp", "2", "--precision", "bf16"}, "dp2_zero2_bf16"}),
    [](const auto& info) { return info.param.name; });

// COMMGRAD_DEBUG=1 (every collective checked across ranks, every send's
// header checked by its receiver) never breaks a correct job: ring
// attention at CP 2 and 4 and every pipeline schedule train and pass
// --check under it, over shm and over Gloo.
TEST(GptTrainExample, EveryLayoutPassesItsCheckUnderTheDebugMode) {
#ifdef COMMGRAD_DEFAULT_LINE_ONLY
  GTEST_SKIP() << "the LibTorch 1.13 line adds nothing to this case (CI time)";
#endif
  const std::vector<std::pair<int, std::vector<std::string>>> layouts{
      {2, {"--cp", "2"}},
      {4, {"--cp", "4"}},
      {2, {"--pp", "2"}},
      {2, {"--pp", "2", "--schedule", "gpipe"}},
      {2, {"--pp", "2", "--schedule", "interleaved"}},
      {2, {"--pp", "2", "--schedule", "zbh1"}},
      {4, {"--tp", "2", "--cp", "2", "--cp-mode", "ulysses"}},
  };
  for (const char* backend : {"shm", "gloo"}) {
    for (const auto& [ranks, layout] : layouts) {
      std::vector<std::string> args{"--check", "--steps", "2", "--curve", "none"};
      args.insert(args.end(), layout.begin(), layout.end());
      auto r = gpt_train(ranks, args, "", {{"COMMGRAD_DEBUG", "1"}, {"COMMGRAD_BACKEND", backend}});
      EXPECT_EQ(r.exit_code, 0) << backend << "\n" << r.out << r.err;
      EXPECT_THAT(r.out, HasSubstr("(L2) (tolerance 1e-03): ok\n")) << backend;
    }
  }
}

// The report: every comparison, the reference named, and without a fault
// each within its tolerance.
TEST(GptTrainExample, CheckComparesGradientsNormsAndParametersWithTheReference) {
  auto r = gpt_train(2, {"--experts", "4", "--dp", "2", "--ep", "2", "--check", "--steps", "3", "--curve", "none"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("check against the one-process reference (LibTorch functions and torch::optim, no "
                               "commgrad code), fp32 tolerances: loss 1e-05, gradient norm 1e-04, gradients 1e-05, "
                               "parameters 1e-03\n"));
  EXPECT_THAT(r.out, HasSubstr("gradient norms: max relative difference"));
  EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-04): ok\n[0] gradients of step 1 (before clipping): 104 tensors"));
  EXPECT_THAT(r.out, HasSubstr("of the reference's movement (L2) (tolerance 1e-03): ok\n"));
  // NaN gradients (and so NaN losses) fail the check too.
  auto nan = gpt_train(2, {"--tp", "2", "--check", "--steps", "2", "--curve", "none"}, "grad-scale:nan");
  EXPECT_EQ(nan.exit_code, 1) << nan.out << nan.err;
  // (The gathering's MAX keeps a NaN or turns it into -inf, by the order of the sum: either fails.)
  EXPECT_TRUE(std::regex_search(nan.out, std::regex(R"(gradients of step 1 \(before clipping\): 52 tensors, the worst )"
                                                    R"('[a-z0-9_.]+' off by -?(nan|inf) .*: MISMATCH\n)")))
      << nan.out;
  EXPECT_THAT(nan.out, HasSubstr("max relative difference from one rank nan (tolerance 1e-05): MISMATCH"));
  // A bad fault is named before any step.
  auto bad = gpt_train(1, {"--steps", "1"}, "grad-scale:two");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("expected grad-scale:F or grad-scale:F:NAME"));
}

// With dropout on, the same layout trained without recompute, with
// selective and with full recompute gives the same losses and the same
// parameters on every rank, bit for bit (gpt_train --check-recompute
// compares them in the program): TP=2 x DP=2 with SP, and TP=2 x PP=2 with
// SP under 1F1B (only the first layer of each stage recomputed),
// interleaved and zbh1 (its deferred weight gradients taken from the rerun).
// The pypi line only: LibTorch 1.13 adds nothing here that tp_recompute_test
// does not check there.
TEST(GptTrainExample, RecomputeWithDropoutEqualsNoRecomputeBitForBit) {
#ifdef COMMGRAD_SECOND_TORCH_LINE
  GTEST_SKIP() << "multi-process recompute runs: the default (pypi) line only";
#endif
  const std::vector<std::vector<std::string>> layouts{
      {"--tp", "2", "--dp", "2", "--sp"},
      {"--tp", "2", "--pp", "2", "--sp", "--recompute", "full", "--recompute-layers", "1"},
      {"--tp", "2", "--pp", "2", "--sp", "--schedule", "interleaved"},
      {"--tp", "2", "--pp", "2", "--sp", "--schedule", "zbh1", "--recompute", "full"},
  };
  for (const auto& layout : layouts) {
    std::vector<std::string> args{"--dropout", "0.1", "--steps", "3", "--check-recompute", "--curve", "none"};
    args.insert(args.end(), layout.begin(), layout.end());
    auto r = gpt_train(4, args);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr(", dropout 0.1"));
    if (layout.back() == "1") {  // --recompute-layers 1: the first layer of each stage
      EXPECT_THAT(r.out, HasSubstr("[0] rank 0 layers: layer0 full, layer1 none\n"));
    }
    EXPECT_THAT(r.out, HasSubstr("[0] recompute none: losses "));
    EXPECT_THAT(r.out, ::testing::Not(HasSubstr("recompute none: losses 4.84335"))) << "dropout changes the loss";
    for (const char* g : {"selective", "full"}) {
      const std::regex line(
          "\\[0\\] recompute " + std::string(g) +
          ": losses [0-9.]+ [0-9.]+ [0-9.]+, rank 0 parameters [0-9a-f]{16}: equal to none bit for bit");
      EXPECT_TRUE(std::regex_search(r.out, line)) << g << "\n" << r.out;
    }
  }
}

// 16-bit compute against one rank computing in the same dtype (tolerance
// 5e-3 for bfloat16, 1e-3 for float16: their rounding); float16 with the
// loss scaler, saved and resumed with its state.
TEST(GptTrainExample, Bfloat16FollowsTheOneRankCurveInItsDtype) {
  auto bf16 = gpt_train(
      4, {"--tp", "2", "--dp", "2", "--fsdp", "--precision", "bf16", "--steps", "4", "--check", "--curve", "none"});
  ASSERT_EQ(bf16.exit_code, 0) << bf16.out << bf16.err;
  EXPECT_THAT(bf16.out, HasSubstr("(tolerance 5e-03): ok\n"));
}

TEST(GptTrainExample, Float16WithTheLossScalerFollowsTheOneRankCurveAndResumes) {
#ifdef COMMGRAD_NO_CPU_FLOAT16
  GTEST_SKIP() << "float16: LibTorch 1.13 has no float16 matmul on the CPU";
#endif
  TempRoot root("gpt_fp16");
  auto fp16 = gpt_train(4, {"--pp", "2", "--dp", "2", "--fsdp", "--precision", "fp16", "--steps", "3", "--check",
                            "--save", root.str(), "--curve", "none"});
  ASSERT_EQ(fp16.exit_code, 0) << fp16.out << fp16.err;
  EXPECT_THAT(fp16.out, HasSubstr("loss scale 65536, 0 steps skipped"));
  EXPECT_THAT(fp16.out, HasSubstr("(tolerance 1e-03): ok\n"));
  auto resumed = gpt_train(2, {"--dp", "2", "--fsdp", "--precision", "fp16", "--steps", "5", "--resume", root.str(),
                               "--check", "--curve", "none"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_THAT(resumed.out, HasSubstr("(tolerance 1e-03): ok\n"));
  // Without --fsdp: ZeRO-2 with the same policy and scaler.
  auto zero = gpt_train(2, {"--dp", "2", "--precision", "fp16", "--steps", "3", "--check", "--curve", "none"});
  ASSERT_EQ(zero.exit_code, 0) << zero.out << zero.err;
  EXPECT_THAT(zero.out, HasSubstr("loss scale 65536, 0 steps skipped"));
  EXPECT_THAT(zero.out, HasSubstr("(tolerance 1e-03): ok\n"));
}

// float16 whose first loss scale (2^20) is so large that the first steps
// overflow: the scaler skips them on every rank alike (inf/NaN agreed over
// DP and PP; hysteresis 2, then halving: here steps 1-4, and 2^17 trains),
// the one-rank run skips the same steps (gpt_train --check compares them),
// and the curve, trained on from there, still follows one rank's.
TEST(GptTrainExample, Float16SkipsTheOverflowingStepsOnEveryRankAlike) {
#ifdef COMMGRAD_DEFAULT_LINE_ONLY
  GTEST_SKIP() << "float16: LibTorch 1.13 has no float16 matmul on the CPU";
#endif
  auto r = gpt_train(4, {"--pp", "2", "--dp", "2", "--fsdp", "--precision", "fp16", "--loss-scale-init", "1048576",
                         "--steps", "6", "--check", "--curve", "none"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::map<int, std::string> skipped;  // by rank
  const std::regex line(R"(\[(\d+)\] rank (\d+) skipped steps: ([0-9 ]+|none)\n)");
  for (std::sregex_iterator it(r.out.begin(), r.out.end(), line), end; it != end; ++it) {
    EXPECT_EQ((*it)[1], (*it)[2]);
    skipped[std::stoi((*it)[2])] = (*it)[3];
  }
  ASSERT_EQ(skipped.size(), 4u) << r.out;
  const std::string steps = skipped[0];
  for (const auto& [rank, s] : skipped) EXPECT_EQ(s, steps) << "rank " << rank << "\n" << r.out;
  // The first steps overflow, the last one trains.
  EXPECT_TRUE(std::regex_match(steps, std::regex("1 2( [345])*"))) << steps;
  EXPECT_THAT(r.out, HasSubstr("skipped steps " + steps + ", one rank " + steps + ": the same\n"));
  EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-03): ok\n"));
  auto fp32 = gpt_train(1, {"--loss-scale-init", "1024"});
  EXPECT_NE(fp32.exit_code, 0);
  EXPECT_THAT(fp32.err, HasSubstr("--loss-scale-init needs --precision fp16"));
}

// --async-save writes in the background while the next steps run: the same
// losses, and the same files byte for byte, as synchronous saves.
TEST(GptTrainExample, AsyncSavesWriteWhatSynchronousSavesWrite) {
  TempRoot sync_root("gpt_sync");
  TempRoot async_root("gpt_async");
  const std::vector<std::string> args = {"--dp", "2", "--steps", "3", "--save-every", "1", "--curve", "none"};
  auto with = [&](const std::string& dir, std::vector<std::string> extra) {
    extra.insert(extra.begin(), args.begin(), args.end());
    extra.insert(extra.end(), {"--save", dir});
    return gpt_train(2, extra);
  };
  const auto sync = with(sync_root.str(), {});
  const auto async = with(async_root.str(), {"--async-save"});
  ASSERT_EQ(sync.exit_code, 0) << sync.out << sync.err;
  ASSERT_EQ(async.exit_code, 0) << async.out << async.err;
  EXPECT_EQ(progress_losses(async.out), progress_losses(sync.out));
  auto bytes = [](const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  for (const char* step : {"step-00000002", "step-00000003"}) {  // keep(2)
    int files = 0;
    for (const auto& f : fs::directory_iterator(sync_root.path() / step)) {
      EXPECT_EQ(bytes(f.path()), bytes(async_root.path() / step / f.path().filename()))
          << step << "/" << f.path().filename();
      ++files;
    }
    EXPECT_GE(files, 2) << step;
  }
}

TEST(GptTrainExample, ResumedUnderAnotherLayoutTheCurveContinues) {
  TempRoot root("gpt");
  const std::string dir = root.str();
  auto saved =
      gpt_train(4, {"--tp", "2", "--pp", "2", "--steps", "3", "--save", dir, "--save-every", "2", "--curve", "none"});
  ASSERT_EQ(saved.exit_code, 0) << saved.out << saved.err;
  EXPECT_THAT(saved.out, HasSubstr("[0] saved step 3 in " + dir));
  EXPECT_TRUE(fs::exists(root.path() / "step-00000002"));  // --save-every 2, and the end
  EXPECT_TRUE(fs::exists(root.path() / "step-00000003"));

  // The same layout: the continuous run's losses, bit for bit.
  auto continuous = gpt_train(4, {"--tp", "2", "--pp", "2", "--steps", "6", "--curve", "none"});
  ASSERT_EQ(continuous.exit_code, 0) << continuous.out << continuous.err;
  auto resumed = gpt_train(4, {"--tp", "2", "--pp", "2", "--steps", "6", "--resume", dir, "--curve", "none"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_THAT(resumed.out, HasSubstr("[0] resumed from step 3 of " + dir + " (saved at TP=2 x PP=2 x DP=1)"));
  const auto want = progress_losses(continuous.out);
  const auto got = progress_losses(resumed.out);
  ASSERT_EQ(want.size(), 6u) << continuous.out;
  ASSERT_EQ(got.size(), 3u) << resumed.out;
  for (int step = 4; step <= 6; ++step) EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;

  // No more steps than the checkpoint holds: an error before any rank starts, not a run that does nothing.
  expect_bad_options(
      build_path("bin/gpt_train"),
      {{{"--steps", "2", "--resume", dir}, "--steps 2: the checkpoint in " + dir + " already holds step 3"},
       {{"--steps", "3", "--resume", dir}, "already holds step 3; nothing to train"}});

  // Other layouts: the one-rank curve from step 1, compared on steps 4-6.
  for (const auto& [ranks, layout] : std::vector<std::pair<int, std::vector<std::string>>>{
           {4, {"--pp", "2", "--dp", "2"}},
           {1, {}},
           {4, {"--tp", "2", "--pp", "2", "--sp", "--schedule", "interleaved"}},
           {4, {"--dp", "4", "--microbatches", "2", "--fsdp"}}}) {
    std::vector<std::string> args{"--steps", "6", "--resume", dir, "--check", "--curve", "none"};
    args.insert(args.end(), layout.begin(), layout.end());
    auto r = gpt_train(ranks, args);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-05): ok\n"));
    EXPECT_THAT(r.out, ::testing::Not(HasSubstr("check step 3/6")));
    EXPECT_THAT(r.out, HasSubstr("check step 6/6"));
  }
}

TEST(GptTrainExample, SavedUnderFsdpResumesUnderZero) {
  TempRoot root("gpt_fsdp");
  const std::string dir = root.str();
  auto saved = gpt_train(4, {"--tp", "2", "--dp", "2", "--fsdp", "--steps", "3", "--save", dir, "--curve", "none"});
  ASSERT_EQ(saved.exit_code, 0) << saved.out << saved.err;
  auto r = gpt_train(4, {"--pp", "2", "--dp", "2", "--steps", "5", "--resume", dir, "--check", "--curve", "none"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("(saved at TP=2 x PP=1 x DP=2 (FSDP))"));
  EXPECT_THAT(r.out, HasSubstr("check step 5/5"));
  EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-05): ok\n"));
}

TEST(GptTrainExample, WritesTheLossCurveAsCsvAndSvg) {
  TempRoot root("curve");
  fs::create_directories(root.path());
  const std::string prefix = (root.path() / "loss").string();
  auto r = gpt_train(2, {"--pp", "2", "--steps", "3", "--check", "--curve", prefix});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] loss curve: " + prefix + ".csv, " + prefix + ".svg"));
  std::ifstream csv(prefix + ".csv");
  std::vector<std::string> rows;
  for (std::string line; std::getline(csv, line);) rows.push_back(line);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[0], "step,loss,one_rank_loss");
  EXPECT_THAT(rows[1], ::testing::StartsWith("1,4.84335"));
  std::ifstream svg(prefix + ".svg");
  std::stringstream text;
  text << svg.rdbuf();
  const std::string drawing = text.str();  // one string: begin() and end() of two copies are UB
  EXPECT_THAT(drawing, HasSubstr("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_GT(std::count(drawing.begin(), drawing.end(), '\n'), 10);
  EXPECT_THAT(drawing, HasSubstr("one rank</text>"));
}

TEST(GptTrainExample, TrainsOnTheBytesOfATextFile) {
  TempRoot root("text");
  fs::create_directories(root.path());
  const std::string file = (root.path() / "corpus.txt").string();
  {
    std::ofstream out(file);
    for (int i = 0; i < 40; ++i) out << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  auto r = gpt_train(2, {"--tp", "2", "--steps", "2", "--check", "--text", file, "--curve", "none"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("vocab 256"));
  EXPECT_THAT(r.out, HasSubstr("data " + file + " ("));
  EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-05): ok\n"));
  r = gpt_train(1, {"--text", (root.path() / "missing.txt").string()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("missing.txt: cannot be read"));
}

// Every layer's FFN a mixture of 4 experts (top-2), split over --ep ranks of
// the data-parallel group (with TP and PP around it), follows the one-rank
// model holding every expert. (The curve is AdamW's, which a constant factor
// on a gradient hardly moves: the factor-of-N bugs are caught by moe_test
// with SGD.)
TEST(GptTrainExample, ExpertParallelFollowsTheOneRankCurve) {
  const std::vector<std::pair<int, std::vector<std::string>>> layouts{
      {2, {"--dp", "2", "--ep", "2"}},
      {4, {"--tp", "2", "--dp", "2", "--ep", "2"}},
      {4, {"--pp", "2", "--dp", "2", "--ep", "2"}},
#ifndef COMMGRAD_DEFAULT_LINE_ONLY
      {4, {"--tp", "2", "--sp", "--dp", "2", "--ep", "2"}},  // each TP rank routes its part of the sequences
      {2, {"--cp", "2", "--ep", "2"}},                       // the experts split over the two CP ranks
#endif
  };
  for (const auto& [ranks, layout] : layouts) {
    std::vector<std::string> args{"--experts", "4", "--topk", "2", "--check", "--steps", "3", "--curve", "none"};
    args.insert(args.end(), layout.begin(), layout.end());
    auto r = gpt_train(ranks, args);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("4 experts (top-2) over EP=2"));
    EXPECT_THAT(r.out, HasSubstr("(one rank 4.79110"));
    EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-05): ok\n"));
  }
  auto r = gpt_train(2, {"--dp", "2", "--ep", "2"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--ep 2 needs --experts divisible by it"));
}

// Experts under fully_shard (a unit of each layer's experts over the
// expert-data group, divided by the data size; one clip_grad_norm_ counting
// each expert once), also under fp16 (the loss scaler sees the expert
// gradients), and under the zero-bubble schedule (the experts' weight
// gradients deferred to W) follow the one-rank curve; so do the router's
// options.
TEST(GptTrainExample, ExpertsUnderFsdpFp16ZeroBubbleAndRouterOptionsFollowTheOneRankCurve) {
#ifdef COMMGRAD_DEFAULT_LINE_ONLY
  GTEST_SKIP() << "the LibTorch 1.13 line adds nothing to this case (CI time)";
#endif
  const std::vector<std::pair<int, std::vector<std::string>>> layouts{
      {2, {"--fsdp", "--dp", "2", "--ep", "2"}},
      {2, {"--fsdp", "--precision", "fp16", "--dp", "2", "--ep", "2"}},
      {4, {"--pp", "2", "--dp", "2", "--ep", "2", "--schedule", "zbh1"}},
      // The router's options: sigmoid scores, z-loss, the aux-loss-free bias, a capacity that drops.
      {2,
       {"--dp", "2", "--ep", "2", "--moe-score", "sigmoid", "--z-loss", "1e-3", "--expert-bias", "1e-3",
        "--capacity-factor", "1"}},
  };
  for (const auto& [ranks, layout] : layouts) {
    std::vector<std::string> args{"--experts", "4", "--topk", "2", "--check", "--steps", "3", "--curve", "none"};
    args.insert(args.end(), layout.begin(), layout.end());
    auto r = gpt_train(ranks, args);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("4 experts (top-2) over EP=2"));
    EXPECT_THAT(r.out, HasSubstr("): ok\n"));
  }
}

// Experts saved at EP=2 resume at EP=1 (each rank then holds every expert and
// the experts' optimizer state is split over DP=2 instead) and continue the
// one-rank curve.
TEST(GptTrainExample, ExpertsSavedAtEp2ResumeAtEp1) {
#ifdef COMMGRAD_DEFAULT_LINE_ONLY
  GTEST_SKIP() << "the LibTorch 1.13 line adds nothing to this case (CI time)";
#endif
  TempRoot root("gpt_experts");
  const std::string dir = root.str();
  const std::vector<std::string> experts{"--experts", "4", "--topk", "2", "--curve", "none"};
  std::vector<std::string> save{"--dp", "2", "--ep", "2", "--steps", "3", "--save", dir};
  save.insert(save.end(), experts.begin(), experts.end());
  auto saved = gpt_train(2, save);
  ASSERT_EQ(saved.exit_code, 0) << saved.out << saved.err;
  std::vector<std::string> resume{"--dp", "2", "--steps", "5", "--resume", dir, "--check"};
  resume.insert(resume.end(), experts.begin(), experts.end());
  auto r = gpt_train(2, resume);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("(saved at TP=1 x PP=1 x DP=2 (EP=2))"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("check step 3/5")));
  EXPECT_THAT(r.out, HasSubstr("check step 5/5"));
  EXPECT_THAT(r.out, HasSubstr("(tolerance 1e-05): ok\n"));
}

TEST(GptTrainExample, LayoutsThatDoNotFitAreErrors) {
  const std::vector<std::pair<std::pair<int, std::vector<std::string>>, std::string>> cases{
      {{3, {"--pp", "3"}}, "gpt_train: 4 layers do not split into 3 stages"},
      {{2, {"--pp", "2", "--schedule", "interleaved", "--stages-per-rank", "4"}},
       "4 layers do not split into 8 stages"},
      {{2, {"--pp", "2", "--stages-per-rank", "2"}}, "--stages-per-rank 2 needs --schedule interleaved"},
      {{2, {"--dp", "2", "--microbatches", "8"}}, "does not split into 2 replicas x 8 microbatches"},
      {{2, {"--tp", "2", "--pp", "2"}}, "--tp 2 x --pp 2 does not divide the world size 2 (--dp auto)"},
      {{2, {"--tp", "2", "--dp", "2"}}, "--tp 2 x --pp 1 x --dp 2 is not the world size 2"},
      {{1, {"--save-every", "2"}}, "--save-every needs --save DIR"},
      {{2, {"--cp", "3"}}, "--cp 3: the sequence of 16 tokens does not split into 2 x 3 chunks (head-tail)"},
      {{2, {"--cp", "2", "--tp", "2"}}, "--tp 2 x --pp 1 x --cp 2 does not divide the world size 2 (--dp auto)"},
  };
  for (const auto& [run, message] : cases) {
    auto r = gpt_train(run.first, run.second);
    EXPECT_NE(r.exit_code, 0) << message;
    EXPECT_THAT(r.err, HasSubstr(message));
  }
}

// Every option in --help; each bad one named, exit code 2, before any rank starts.
TEST(GptTrainExample, BadOptionsAreNamedBeforeAnyRankStarts) {
  const std::string program = build_path("bin/gpt_train");
  expect_help_lists(program, {"--tp", "--pp", "--dp", "--sp", "--microbatches", "--steps", "--schedule",
                              "--stages-per-rank", "--save", "--save-every", "--resume", "--text", "--curve", "--check",
                              "--recompute", "--cp", "--cp-mode"});
  expect_help_lists(program, {"--dropout", "--recompute-layers", "--check-recompute"});
  expect_help_lists(program,
                    {"--experts", "--moe-score", "--aux-loss", "--z-loss", "--expert-bias", "--capacity-factor"});
  const std::string positive = "expected an integer in [1, 2147483647]";
  expect_bad_options(
      program,
      {
          {{"--bogus"}, "unknown option '--bogus'"},
          {{"--tp", "2", "--bogus", "1"}, "unknown option '--bogus'"},
          {{"extra"}, "unexpected argument 'extra'"},
          {{"--microbatches", "0"}, "--microbatches: " + positive + ", got '0'"},
          {{"--dp", "0"}, "--dp: expected auto or an integer in [1, 2147483647], got '0'"},
          {{"--dp", "many"}, "--dp: expected auto or an integer in [1, 2147483647], got 'many'"},
          {{"--tp", "0"}, "--tp: " + positive + ", got '0'"},
          {{"--pp", "0"}, "--pp: " + positive + ", got '0'"},
          {{"--tp", "two"}, "--tp: " + positive + ", got 'two'"},
          {{"--tp", "2x"}, "--tp: " + positive + ", got '2x'"},
          {{"--steps", "99999999999"}, "--steps: " + positive + ", got '99999999999'"},
          {{"--steps", "-1"}, "--steps: " + positive + ", got '-1'"},
          {{"--steps", "0"}, "--steps: " + positive + ", got '0'"},
          {{"--steps"}, "--steps: 1 required"},
          {{"--schedule", "interleaved", "--stages-per-rank", "-1"}, "--stages-per-rank: expected an integer in [0, "},
          {{"--schedule", "zb"}, "--schedule: expected one of 1f1b, gpipe, interleaved, zbh1, got 'zb'"},
          {{"--save-every", "-2", "--save", "x"}, "--save-every: expected an integer in [0, "},
          {{"--check=1"}, "--check takes no value"},
          {{"--dp", "65536", "--microbatches", "65536"}, "does not split into 65536 replicas x 65536 microbatches"},
          {{"--pp", "2", "--stages-per-rank", "2"}, "--stages-per-rank 2 needs --schedule interleaved"},
          {{"--save-every", "2"}, "--save-every needs --save DIR"},
          {{"--precision", "fp16", "--experts", "2"}, "--precision fp16 with --experts needs --fsdp"},
          {{"--precision", "fp8"}, "--precision: expected one of fp32, bf16, fp16, got 'fp8'"},
          {{"--recompute", "partial"}, "--recompute: expected one of none, selective, full, got 'partial'"},
          {{"--recompute-layers", "1"}, "--recompute-layers 1 needs --recompute selective or full"},
          {{"--dropout", "0.1", "--check"}, "with --dropout use --check-recompute"},
          {{"--dropout", "1.5"}, "--dropout: expected a number >= 0 and <= 0.9, got '1.5'"},
          {{"--dropout", "0.1", "--cp", "2"}, "--dropout does not combine with --cp"},
          {{"--experts", "4", "--topk", "5"}, "--topk 5 is more than the 4 experts"},
          {{"--moe-score", "sigmoid"},
           "the router options (--moe-score, --aux-loss, --z-loss, --expert-bias, "
           "--capacity-factor) need --experts"},
          {{"--moe-score", "tanh"}, "--moe-score: expected one of softmax, sigmoid, got 'tanh'"},
          {{"--experts", "4", "--capacity-factor", "1", "--check", "--tp", "2", "--sp"},
           "--capacity-factor with --check: not with --sp or --cp"},
      });
}

}  // namespace
}  // namespace commgrad::testing
