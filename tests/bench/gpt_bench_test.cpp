// bench/gpt_bench as a user runs it, at a tiny size for one or two steps:
// rank 0 prints the header and one row per layout of the job's world, with
// the measured bubble beside the closed form pp::bubble_fraction_closed_form
// gives; a layout of another world is skipped with a note; bad options end
// every rank with a message (exit code 2, before any rank starts); so do the
// options of the other benchmark programs. zero_bench's tables at a tiny
// size: bytes against the formulas, FSDP's collectives against the closed form.
// recompute_bench's bytes held for backward against the closed form.

#include "harness/command_line.h"
#include "harness/subprocess.h"
#include "harness/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

const std::vector<std::string> kTiny = {"--hidden",   "32", "--heads", "4",  "--ffn",   "64", "--layers",       "4",
                                        "--sequence", "16", "--vocab", "64", "--batch", "8",  "--microbatches", "4",
                                        "--warmup",   "1",  "--steps", "1"};

ProcessResult gpt_bench(int n, std::vector<std::string> args) {
  std::vector<std::string> argv = {launcher_path(), "-n", std::to_string(n),
                                   "--timeout",     "60", build_path("bin/gpt_bench")};
  argv.insert(argv.end(), kTiny.begin(), kTiny.end());
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, clean_env({{"COMMGRAD_TIMEOUT", "30"}}), std::chrono::seconds(90));
}

// The cells of the header and data rows of rank 0's table ("| a | b |" -> {"a", "b"}).
std::vector<std::vector<std::string>> table(const std::string& out) {
  std::vector<std::vector<std::string>> rows;
  for (const std::string& line : lines_with_prefix(out, "[0] | ")) {
    std::vector<std::string> cells;
    std::istringstream in(line.substr(5));
    for (std::string cell; std::getline(in, cell, '|');) {
      const auto b = cell.find_first_not_of(' '), e = cell.find_last_not_of(' ');
      if (b != std::string::npos) cells.push_back(cell.substr(b, e - b + 1));
    }
    rows.push_back(cells);
  }
  return rows;
}

TEST(GptBench, PrintsARowPerLayoutWithTheBubbleBesideTheClosedForm) {
  const auto r = gpt_bench(
      2, {"--layout", "1,2,1", "--layout", "1,2,1,interleaved", "--layout", "1,1,2", "--layout", "2,2,1,gpipe"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] gpt_bench: 2 ranks"));
  EXPECT_THAT(r.out, HasSubstr("GPT 4 layers, hidden 32, 4 heads, ffn 64, vocab 64, sequence 16, tied embeddings"));
  const auto rows = table(r.out);
  ASSERT_EQ(rows.size(), 4u) << r.out;  // header, three layouts
  EXPECT_EQ(rows[0], (std::vector<std::string>{"layout", "schedule", "v", "tokens/s", "step p50 (ms)",
                                               "bubble measured", "bubble closed form", "measured / closed",
                                               "busiest rank", "busiest / closed", "loss"}));
  // The closed forms at p = 2, m = 4: 1/5, interleaved v = 2: 1/9; none without a pipeline.
  const std::vector<std::vector<std::string>> expected = {{"TP=1 x PP=2 x DP=1", "1f1b", "1", "0.200"},
                                                          {"TP=1 x PP=2 x DP=1", "interleaved", "2", "0.111"},
                                                          {"TP=1 x PP=1 x DP=2", "-", "1", "0.000"}};
  for (size_t k = 0; k < expected.size(); ++k) {
    const auto& row = rows[k + 1];
    ASSERT_EQ(row.size(), 11u) << r.out;
    EXPECT_EQ(row[0], expected[k][0]);
    EXPECT_EQ(row[1], expected[k][1]);
    EXPECT_EQ(row[2], expected[k][2]);
    EXPECT_EQ(row[6], expected[k][3]);
    EXPECT_GT(std::stod(row[3]), 0.0) << "tokens/s: " << r.out;
    const double bubble = std::stod(row[5]);
    EXPECT_GE(bubble, -0.01) << r.out;
    EXPECT_LT(bubble, 1.0) << r.out;
    const double busiest = std::stod(row[8]);  // idle share of the busiest rank: at most the average one
    EXPECT_LE(busiest, bubble + 0.002) << r.out;
    if (k < 2) {
      EXPECT_NEAR(std::stod(row[7]), bubble / std::stod(row[6]), 0.02) << r.out;
      EXPECT_NEAR(std::stod(row[9]), busiest / std::stod(row[6]), 0.02) << r.out;
    } else {
      EXPECT_EQ(row[7], "-");
      EXPECT_EQ(row[9], "-");
    }
  }
  EXPECT_THAT(r.out, HasSubstr("[0] note: TP=2 x PP=2 x DP=1 gpipe: skipped, it needs 4 ranks and the job has 2"));
}

TEST(GptBench, ZeroBubbleClosedFormUsesTheMeasuredCosts) {
  const auto r = gpt_bench(2, {"--layout", "1,2,1,zbh1"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto rows = table(r.out);
  ASSERT_EQ(rows.size(), 2u) << r.out;
  ASSERT_EQ(rows[1].size(), 11u) << r.out;
  EXPECT_EQ(rows[1][1], "zbh1");
  // (F + B - W) / (4 (F + B + W) + F + B - W) lies in (0, 1/5) for any positive costs.
  const double closed = std::stod(rows[1][6]);
  EXPECT_GT(closed, 0.0) << r.out;
  EXPECT_LT(closed, 0.2) << r.out;
}

TEST(GptBench, UntiedOutputLayer) {
  const auto r = gpt_bench(2, {"--untie", "--layout", "1,2,1,gpipe"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("untied output layer"));
  const auto rows = table(r.out);
  ASSERT_EQ(rows.size(), 2u) << r.out;
  EXPECT_EQ(rows[1][1], "gpipe");
}

// With experts: the header names them, a layout EP divides gets a row, one
// it does not divide is skipped with a note.
TEST(GptBench, ExpertsSplitOverEp) {
  const auto r = gpt_bench(2, {"--experts", "4", "--ep", "2", "--layout", "1,1,2", "--layout", "2,1,1"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("; 4 experts (top-2) over EP=2"));
  const auto rows = table(r.out);
  ASSERT_EQ(rows.size(), 2u) << r.out;
  EXPECT_EQ(rows[1][0], "TP=1 x PP=1 x DP=2");
  EXPECT_GT(std::stod(rows[1][3]), 0.0) << "tokens/s: " << r.out;
  EXPECT_THAT(r.out,
              HasSubstr("[0] note: TP=2 x PP=1 x DP=1 -: skipped, --ep 2 does not divide its data x context ranks"));
}

TEST(GptBench, BadOptionsEndEveryRankWithAMessage) {
  COMMGRAD_COMMAND_LINE_CASES_ON_THE_DEFAULT_LINE_ONLY();
  auto r = gpt_bench(2, {"--layout", "1,2"});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--layout '1,2': expected TP,PP,DP[,SCHEDULE[,V]]"));
  r = gpt_bench(2, {"--layout", "1,2,1,zb"});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("schedule must be 1f1b, gpipe, interleaved or zbh1"));
}

// Every option in --help; each bad one named, exit code 2, before any rank starts.
TEST(GptBench, BadOptionsAreNamedBeforeAnyRankStarts) {
  const std::string program = build_path("bin/gpt_bench");
  expect_help_lists(program, {"--layout", "--hidden", "--heads", "--ffn", "--layers", "--sequence", "--vocab",
                              "--batch", "--microbatches", "--warmup", "--steps", "--untie", "--cp", "--cp-mode",
                              "--experts", "--topk", "--ep", "--recompute"});
  expect_bad_options(
      program,
      {
          {{"--bogus"}, "unknown option '--bogus'"},
          {{"--microbatches", "0"}, "--microbatches: expected an integer in [1, 2147483647], got '0'"},
          {{"--steps", "-1"}, "--steps: expected an integer in [1, 2147483647], got '-1'"},
          {{"--steps", "99999999999"}, "--steps: expected an integer in [1, 2147483647], got '99999999999'"},
          {{"--warmup", "-1"}, "--warmup: expected an integer in [0, 2147483647], got '-1'"},
          {{"--hidden", "wide"}, "--hidden: expected an integer in [1, 9223372036854775807], got 'wide'"},
          {{"--batch", "0"}, "--batch: expected an integer in [1, "},
          {{"--layout", "0,1,1"}, "--layout '0,1,1': sizes are integers of at least 1, got '0'"},
          {{"--layout", "two,1,1"}, "--layout 'two,1,1': sizes are integers of at least 1, got 'two'"},
          {{"--layout", "1,2,1,interleaved,-1"}, "--layout '1,2,1,interleaved,-1': sizes are integers of at least 1"},
          {{"--layout", "1,2,1,1f1b,2"}, "--layout '1,2,1,1f1b,2': V needs the interleaved schedule"},
          {{"--untie=1"}, "--untie takes no value"},
          {{"--ep", "2"}, "--ep 2 needs --experts divisible by it"},
          {{"--experts", "3", "--ep", "2"}, "--ep 2 needs --experts divisible by it"},
          {{"--experts", "2", "--topk", "3"}, "--topk 3 is more than the 2 experts"},
          {{"--experts", "-1"}, "--experts: expected an integer in [0, "},
          {{"--recompute", "none,partial"}, "--recompute: expected one of none, selective, full, got 'partial'"},
      });
}

// recompute_bench at a small size (one layer, one step): the bytes each
// granularity holds for backward, counted exactly, meet the closed form
// (the float32 form of 34sbh + 5as^2b; selective without the s^2 term; full
// the layer input, plus recompute's snapshot of the random streams, a few
// KB); every row has a step time.
TEST(RecomputeBench, HeldBytesMeetTheClosedForm) {
  auto r = run_process({launcher_path(), "-n",  "1",       "--timeout", "60",       build_path("bin/recompute_bench"),
                        "--sequence",    "256", "--batch", "2",         "--hidden", "256",
                        "--heads",       "4",   "--ffn",   "512",       "--layers", "1",
                        "--warmup",      "0",   "--steps", "1"},
                       clean_env(), std::chrono::seconds(90));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto rows = table(r.out);
  ASSERT_EQ(rows.size(), 4u) << r.out;  // header, none, selective, full
  const std::vector<std::pair<std::string, double>> want{{"none", 0.02}, {"selective", 0.02}, {"full", 0.05}};
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& row = rows[1 + i];
    ASSERT_EQ(row.size(), 6u) << r.out;
    EXPECT_EQ(row[0], want[i].first);
    const double ratio = std::stod(row[3]);  // measured / closed form
    EXPECT_GE(ratio, 1.0) << row[0];
    EXPECT_LE(ratio, 1.0 + want[i].second) << row[0];
    EXPECT_GT(std::stod(row[4]), 0.0) << row[0];
  }
  const std::string program = build_path("bin/recompute_bench");
  expect_help_lists(program, {"--sequence", "--batch", "--hidden", "--heads", "--ffn", "--layers", "--dropout", "--sp",
                              "--warmup", "--steps"});
  expect_bad_options(program, {
                                  {{"--dropout", "1"}, "--dropout: expected a number >= 0 and <= 0.9, got '1'"},
                                  {{"--layers", "0"}, "--layers: expected an integer in [1, "},
                              });
}

// zero_bench at a tiny size: every variant's bytes meet its formula exactly
// (no padding at 2 ranks), FSDP's collectives per step meet the closed form
// (2 all-gathers per unit with resharding, 1 without; a reduce-scatter per
// unit; 3 Psi and 2 Psi moved), and every variant has a step time, also in
// the --times file (bench/fsdp_compare.sh reads it): a row per measured step.
TEST(ZeroBench, BytesAndFsdpCollectivesMeetTheClosedForms) {
  TempRoot dir("zero_bench");
  fs::create_directories(dir.path());
  const auto times_file = (dir.path() / "times.csv").string();
  const auto r = run_process({launcher_path(), "-n", "2", "--timeout", "60", build_path("bin/zero_bench"), "--layers",
                              "2", "--width", "64", "--batch", "4", "--steps", "2", "--times", times_file},
                             clean_env({{"COMMGRAD_TIMEOUT", "30"}}), std::chrono::seconds(90));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  int memory = 0, collectives = 0, times = 0;
  for (const auto& row : table(r.out)) {
    if (row.empty() || row[0] == "variant" || row[0].rfind("---", 0) == 0) continue;
    const bool fsdp = row[0].rfind("FSDP", 0) == 0;
    const bool reshard = row[0] == "FSDP + Adam, reshard after forward";
    SCOPED_TRACE(row[0]);
    if (row.size() == 9) {  // memory: state / formula, total / formula
      ++memory;
      EXPECT_EQ(row[4], "1.000");
      EXPECT_EQ(row[7], "1.000");
    } else if (row.size() == 10 && fsdp) {  // FSDP collectives
      ++collectives;
      EXPECT_EQ(row[1], reshard ? "4" : "2");
      EXPECT_EQ(row[1], row[2]);
      EXPECT_EQ(row[4], "2");
      EXPECT_EQ(row[4], row[5]);
      EXPECT_EQ(row[8], reshard ? "3.000" : "2.000");
    } else if (row.size() == 6) {
      ++times;
      EXPECT_GT(std::stod(row[1]), 0.0);
    }
  }
  EXPECT_EQ(memory, 6) << r.out;
  EXPECT_EQ(collectives, 2) << r.out;
  EXPECT_EQ(times, 6) << r.out;
  std::ifstream in(times_file);
  std::vector<std::string> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(line);
  ASSERT_EQ(rows.size(), 1u + 6 * 2) << r.out;  // the header, 6 variants x 2 steps
  EXPECT_EQ(rows[0], "implementation,backend,ranks,variant,step,ms");
  EXPECT_THAT(rows[1], ::testing::StartsWith("commgrad,shm,2,\"DDP + Adam\",1,"));
  EXPECT_THAT(rows[12], ::testing::StartsWith("commgrad,shm,2,\"FSDP + Adam, no reshard\",2,"));
  EXPECT_GT(std::stod(rows[12].substr(rows[12].rfind(',') + 1)), 0.0);
}

// The data-parallel and tensor-parallel benchmarks take their options the same way.
TEST(BenchPrograms, BadOptionsAreNamedBeforeAnyRankStarts) {
  for (const std::string name : {"ddp_bench", "zero_bench"}) {
    const std::string program = build_path("bin/" + name);
    expect_help_lists(program, {"--layers", "--width", "--batch", "--steps", "--bucket-cap-mb"});
    expect_bad_options(
        program, {
                     {{"--bogus", "1"}, "unknown option '--bogus'"},
                     {{"--layers", "0"}, "--layers: expected an integer in [1, 2147483647], got '0'"},
                     {{"--width", "-4"}, "--width: expected an integer in [1, 2147483647], got '-4'"},
                     {{"--batch", "many"}, "--batch: expected an integer in [1, 2147483647], got 'many'"},
                     {{"--steps", "-1"}, "--steps: expected an integer in [1, 2147483647], got '-1'"},
                     {{"--steps", "99999999999"}, "--steps: expected an integer in [1, 2147483647], got '99999999999'"},
                     {{"--bucket-cap-mb", "0"}, "--bucket-cap-mb: expected a number > 0, got '0'"},
                     {{"--steps"}, "--steps: 1 required"},
                 });
  }
  const std::string program = build_path("bin/tp_mlp_bench");
  expect_help_lists(program, {"--hidden", "--ffn", "--tokens", "--steps", "--warmup", "--threads"});
  expect_bad_options(
      program, {
                   {{"--bogus"}, "unknown option '--bogus'"},
                   {{"--hidden", "0"}, "--hidden: expected an integer in [1, 9223372036854775807], got '0'"},
                   {{"--tokens", "x"}, "--tokens: expected an integer in [1, "},
                   {{"--steps", "-1"}, "--steps: expected an integer in [1, 2147483647], got '-1'"},
                   {{"--steps", "99999999999"}, "--steps: expected an integer in [1, 2147483647], got '99999999999'"},
                   {{"--warmup", "-1"}, "--warmup: expected an integer in [0, 2147483647], got '-1'"},
                   {{"--threads", "-2"}, "--threads: expected an integer in [0, 2147483647], got '-2'"},
               });
  const std::string cp_bench = build_path("bin/cp_attention_bench");
  expect_help_lists(cp_bench,
                    {"--seq", "--heads", "--head-dim", "--batch", "--mode", "--steps", "--warmup", "--causal"});
  expect_bad_options(cp_bench, {
                                   {{"--seq", "0"}, "--seq: expected an integer in [1, 9223372036854775807], got '0'"},
                                   {{"--mode", "p2p"}, "--mode"},
                               });
}

}  // namespace
}  // namespace commgrad::testing
