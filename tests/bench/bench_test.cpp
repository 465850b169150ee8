// commgrad-bench as a user runs it: under commgrad-run, every op, over Gloo
// and shm. Each table must have one row per size, with no wrong element in
// either the raw or the differentiable result (the bench checks both against
// expected values on every rank), and the forward+backward and floor columns
// where the dtype has gradients; with --link-gbps, the link floor of the
// group's host layout (ranks started by hand with COMMGRAD_HOST, as
// tests/dist/hierarchy_test does). Bad options end every rank with a message.

#include "harness/command_line.h"
#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::vector<std::string> kOps = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                       "scatter",    "gather",     "all_to_all",     "send_recv"};

ProcessResult bench(int n, const std::string& backend, std::vector<std::string> args) {
  std::vector<std::string> argv = {launcher_path(), "-n",   std::to_string(n),
                                   "--timeout",     "120",  build_path("bin/commgrad-bench"),
                                   "--backend",     backend};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, clean_env({{"COMMGRAD_TIMEOUT", "60"}}), std::chrono::seconds(150));
}

// Ranks started by hand, rank q on host hosts[q] ("ABB": rank 0 alone on A).
ProcessResult bench_on_hosts(const std::string& hosts, const std::string& args) {
  std::vector<int> host_of_rank;
  for (char h : hosts) host_of_rank.push_back(h - 'A');
  return run_on_hosts(host_of_rank, build_path("bin/commgrad-bench"), args, {{"COMMGRAD_TIMEOUT", "60"}});
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::istringstream in(s);
  for (std::string part; std::getline(in, part, sep);) parts.push_back(part);
  return parts;
}

std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> w;
  std::istringstream in(s);
  for (std::string x; in >> x;) w.push_back(x);
  return w;
}

// The data rows of the table that follows "# commgrad-bench <op>:" in rank 0's output.
std::vector<std::string> rows_of(const std::string& out, const std::string& op) {
  std::vector<std::string> rows;
  bool in_table = false;
  for (const std::string& line : lines_with_prefix(out, "[0] ")) {
    const std::string body = line.substr(4);
    if (body.rfind("# commgrad-bench ", 0) == 0) in_table = body.rfind("# commgrad-bench " + op + ":", 0) == 0;
    if (in_table && !body.empty() && body[0] != '#') rows.push_back(body);
  }
  return rows;
}

class BenchAllOps : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(BenchAllOps, EveryTableIsCompleteAndEveryResultRight) {
  const auto [n, backend] = GetParam();
  const auto r =
      bench(n, backend, {"--op", "all", "-b", "4K", "-e", "64K", "-f", "4", "--iters", "3", "--warmup", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const std::string& op : kOps) {
    SCOPED_TRACE(op);
    EXPECT_THAT(r.out, HasSubstr("[0] # commgrad-bench " + op + ": " + std::to_string(n) + " ranks, backend " +
                                 backend + ", float"));
    const auto rows = rows_of(r.out, op);
    ASSERT_EQ(rows.size(), 3u) << r.out;  // 4K, 16K, 64K
    for (const std::string& row : rows) {
      const auto groups = split(row, '|');
      ASSERT_EQ(groups.size(), 6u) << row;
      const auto raw = words(groups[1]), fwd = words(groups[2]), fb = words(groups[3]), floor = words(groups[4]);
      ASSERT_EQ(raw.size(), 4u) << row;
      ASSERT_EQ(fwd.size(), 4u) << row;
      EXPECT_EQ(raw[3], "0") << "wrong elements in the raw result: " << row;
      EXPECT_EQ(fwd[3], "0") << "wrong elements in the differentiable result: " << row;
      ASSERT_EQ(fb.size(), 3u) << row;  // time, busbw, xraw
      ASSERT_EQ(floor.size(), 2u) << row;
      EXPECT_GT(std::stod(fb[0]), 0.0) << row;
      EXPECT_GT(std::stod(floor[0]), 0.0) << row;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, BenchAllOps,
                         ::testing::Values(std::make_tuple(2, std::string("gloo")),
                                           std::make_tuple(3, std::string("shm"))),
                         [](const auto& info) {
                           return std::get<1>(info.param) + "_n" + std::to_string(std::get<0>(info.param));
                         });

TEST(Bench, IntegerTypesHaveNoGradientColumns) {
  const auto r = bench(
      2, "shm",
      {"--op", "all_reduce", "-d", "int32", "-o", "max", "-b", "4K", "-e", "4K", "--iters", "2", "--warmup", "0"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto rows = rows_of(r.out, "all_reduce");
  ASSERT_EQ(rows.size(), 1u) << r.out;
  const auto groups = split(rows[0], '|');
  ASSERT_EQ(groups.size(), 6u) << rows[0];
  EXPECT_THAT(words(groups[0]), ::testing::ElementsAre("4096", "1024", "int32", "max", "-1"));
  EXPECT_EQ(words(groups[1])[3], "0") << rows[0];
  EXPECT_EQ(words(groups[2])[3], "0") << rows[0];
  EXPECT_EQ(words(groups[3]), std::vector<std::string>{"n/a"}) << rows[0];
}

// --raw-only with --sweeps (the transport comparison's mode): the raw call
// timed and checked, every differentiable column n/a, one row per size
// after all the sweeps.
TEST(Bench, RawOnlyTimesTheTransportCallAlone) {
  const auto r = bench(2, "shm",
                       {"--op", "all_reduce", "-b", "4K", "-e", "64K", "-f", "16", "--iters", "2", "--warmup", "0",
                        "--raw-only", "--sweeps", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("iters 2, warmup 0, sweeps 3"));
  const auto rows = rows_of(r.out, "all_reduce");
  ASSERT_EQ(rows.size(), 2u) << r.out;  // 4K, 64K
  for (const std::string& row : rows) {
    const auto groups = split(row, '|');
    ASSERT_EQ(groups.size(), 6u) << row;
    EXPECT_GT(std::stod(words(groups[1])[0]), 0) << row;
    EXPECT_EQ(words(groups[1])[3], "0") << row;
    for (size_t g = 2; g < groups.size(); ++g) EXPECT_EQ(words(groups[g]), std::vector<std::string>{"n/a"}) << row;
  }
  EXPECT_THAT(r.out, HasSubstr("# Avg bus bandwidth: raw "));
  EXPECT_THAT(r.out, Not(HasSubstr("GB/s, differentiable forward")));
}

// --fresh-input: every collective's source written again before each call
// (with the input's values, so that every result still checks out); and
// --offset: every buffer of the raw calls 52 bytes past an aligned start.
TEST(Bench, FreshInputAtAnOffsetKeepsEveryResultRight) {
  const auto r = bench(2, "shm",
                       {"--op", "all", "-b", "4K", "-e", "64K", "-f", "16", "--iters", "2", "--warmup", "1",
                        "--raw-only", "--fresh-input", "--offset", "52"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("iters 2, warmup 1, sweeps 1, fresh input, offset 52 B"));
  for (const std::string op : {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "scatter", "gather",
                               "all_to_all", "send_recv"}) {
    const auto rows = rows_of(r.out, op);
    ASSERT_EQ(rows.size(), 2u) << op << "\n" << r.out;
    for (const std::string& row : rows) EXPECT_EQ(words(split(row, '|')[1])[3], "0") << op << ": " << row;
  }
}

// The link floor: bytes across the busiest host link / bandwidth + latency x
// steps among hosts (docs/benchmarks.md), on 1 + 2 ranks over two hosts (the
// lone rank's link is the busiest), and xfloor = raw time / floor.
TEST(Bench, LinkFloorFollowsTheOpAndTheHostLayout) {
  const double gbps = 2, latency = 10;
  const auto r = bench_on_hosts("ABB",
                                "--op all -b 4K -e 64K -f 16 --iters 2 --warmup 0 --no-backward "
                                "--link-gbps 2 --link-latency-us 10");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("backend hierarchical"));
  // Bytes across the link per byte of the table's size, and steps among the 2 hosts.
  const std::vector<std::tuple<std::string, double, int>> floors = {
      {"all_reduce", 1.0, 2}, {"all_gather", 2.0 / 3, 1}, {"reduce_scatter", 2.0 / 3, 1}};
  for (const auto& [op, volume, rounds] : floors) {
    SCOPED_TRACE(op);
    const auto rows = rows_of(r.out, op);
    ASSERT_EQ(rows.size(), 2u) << r.out;  // 4K, 64K
    for (const std::string& row : rows) {
      const auto groups = split(row, '|');
      ASSERT_EQ(groups.size(), 7u) << row;
      const double size = std::stod(words(groups[0])[0]);
      const double raw = std::stod(words(groups[1])[0]);
      const auto link = words(groups[6]);
      ASSERT_EQ(link.size(), 2u) << row;
      const double floor = volume * size * 8 / (gbps * 1e3) + rounds * latency;
      EXPECT_NEAR(std::stod(link[0]), floor, 0.051) << row;
      EXPECT_NEAR(std::stod(link[1]), raw / floor, 0.006 + 0.001 * raw / floor) << row;
    }
  }
  for (const std::string op : {"broadcast", "all_to_all"}) {  // no floor
    const auto rows = rows_of(r.out, op);
    ASSERT_FALSE(rows.empty()) << r.out;
    EXPECT_THAT(words(split(rows[0], '|')[6]), ::testing::ElementsAre("-", "-")) << rows[0];
  }
}

TEST(Bench, LinkFloorIsAbsentOnOneHost) {
  const auto r = bench(
      2, "shm", {"--op", "all_reduce", "-b", "4K", "-e", "4K", "--iters", "1", "--warmup", "0", "--link-gbps", "10"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto rows = rows_of(r.out, "all_reduce");
  ASSERT_EQ(rows.size(), 1u) << r.out;
  const auto groups = split(rows[0], '|');
  ASSERT_EQ(groups.size(), 7u) << rows[0];
  EXPECT_THAT(words(groups[6]), ::testing::ElementsAre("-", "-")) << rows[0];
}

TEST(Bench, BadOptionsEndEveryRankWithAMessage) {
  COMMGRAD_COMMAND_LINE_CASES_ON_THE_DEFAULT_LINE_ONLY();
  struct Case {
    int ranks;
    std::vector<std::string> args;
    std::string message;
  };
  // A bad command line: exit code 2 before any rank starts. A root outside
  // the world is found once the ranks know its size: exit code 1.
  const std::vector<Case> cases = {
      {2, {"--op", "allreduce"}, "unknown --op 'allreduce'"},
      {1, {"-b", "4Q"}, "--minbytes: expected a size in bytes such as 4K, 1M or 1G, got '4Q'"},
      {1, {"--link-gbps", "0"}, "--link-gbps: expected a number > 0, got '0'"},
      {1, {"--link-gbps", "10G"}, "--link-gbps: expected a number > 0, got '10G'"},
      {1, {"--link-latency-us", "50"}, "--link-latency-us needs --link-gbps"},
  };
  for (const auto& c : cases) {
    const auto r = bench(c.ranks, "gloo", c.args);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
  const auto r = bench(2, "gloo", {"--root", "2", "--op", "broadcast"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--root 2 is outside 0..1"));
}

// Every option in --help; each bad one named, exit code 2, before any rank starts.
TEST(Bench, BadOptionsAreNamedBeforeAnyRankStarts) {
  const std::string program = build_path("bin/commgrad-bench");
  expect_help_lists(
      program, {"--op", "--backend", "-b,--minbytes", "-e,--maxbytes", "-f,--stepfactor", "-d,--dtype", "-o,--redop",
                "-r,--root", "-n,--iters", "-w,--warmup", "--sweeps", "-c,--check", "--no-backward", "--raw-only",
                "--fresh-input", "--offset", "--link-gbps", "--link-latency-us"});
  expect_bad_options(
      program,
      {
          {{"--bogus"}, "unknown option '--bogus'"},
          {{"--op", "allreduce"}, "unknown --op 'allreduce'"},
          {{"-e", "64X"}, "--maxbytes: expected a size in bytes such as 4K, 1M or 1G, got '64X'"},
          {{"-f", "1"}, "--stepfactor: expected an integer in [2, 9223372036854775807], got '1'"},
          {{"-d", "float128"}, "--dtype: expected float32, float64, float16, bfloat16, int32, int64, int8 or uint8"},
          {{"-o", "xor"}, "--redop: expected sum, avg, max, min or prod, got 'xor'"},
          {{"-r", "-1"}, "--root: expected an integer in [0, 2147483647], got '-1'"},
          {{"--iters", "0"}, "--iters: expected an integer in [1, 2147483647], got '0'"},
          {{"-n", "99999999999"}, "--iters: expected an integer in [1, 2147483647], got '99999999999'"},
          {{"--warmup", "-1"}, "--warmup: expected an integer in [0, 2147483647], got '-1'"},
          {{"--sweeps", "0"}, "--sweeps: expected an integer in [1, 2147483647], got '0'"},
          {{"-c", "2"}, "--check: expected an integer in [0, 1], got '2'"},
          {{"--no-backward=1"}, "--no-backward takes no value"},
          {{"--offset", "4096"}, "--offset: expected an integer in [0, 4095], got '4096'"},
          {{"--offset", "2"}, "--offset 2 is not a multiple of float32's 4 bytes"},
          {{"-d", "float64", "--offset", "4"}, "--offset 4 is not a multiple of float64's 8 bytes"},
      });
}

}  // namespace
}  // namespace commgrad::testing
