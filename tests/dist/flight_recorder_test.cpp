// The flight recorder on thread ranks: what it records of each collective,
// the dump it writes (read back by commgrad-trace's reader), the ring's
// size (COMMGRAD_TRACE_BUFFER_SIZE; CTest runs this file again with 4), a
// timeout that dumps by itself, and the diagnosis of that dump.

#include "commgrad/dist/flight_recorder.h"
#include "commgrad/dist/process_group.h"
#include "commgrad/ops/collectives.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/env.h"
#include "harness/expect_error.h"
#include "harness/spawn_ranks.h"
#include "harness/temp_dir.h"

#include "diagnosis.h"
#include "dumps.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>

namespace commgrad {
namespace {

using ::testing::HasSubstr;
using testing::spawn_ranks;
using testing::TempRoot;

// COMMGRAD_TRACE_DIR for the length of a test.
class TraceDir {
 public:
  explicit TraceDir(const std::string& tag) : root_(tag) { ::setenv("COMMGRAD_TRACE_DIR", root_.str().c_str(), 1); }
  ~TraceDir() { ::unsetenv("COMMGRAD_TRACE_DIR"); }
  std::string str() const { return root_.str(); }

 private:
  TempRoot root_;
};

// The entries of `dump` on the group whose members are `ranks`, newest group only.
std::vector<trace::Entry> on_group(const trace::Dump& dump, const std::vector<int>& ranks) {
  std::vector<trace::Entry> out;
  for (const auto& e : dump.entries) {
    if (e.ranks != ranks) continue;
    if (!out.empty() && e.seq <= out.back().seq) out.clear();
    out.push_back(e);
  }
  return out;
}

int64_t ring_size() { return env::get_count("COMMGRAD_TRACE_BUFFER_SIZE", "collectives").value_or(2000); }

TEST(FlightRecorderTest, RecordsEachCollectiveWithItsGroupNumberSizesAndState) {
  TraceDir dir("records");
  spawn_ranks(2, [](Group& g) {
    for (int i = 0; i < 3; ++i) ops::all_reduce(at::ones({3}), {}, g);
    ops::all_gather(at::ones({2, 2}, at::kDouble), {}, g);
    ops::raw::all_reduce(at::ones({5}), {}, g);  // dropped without a wait
    ops::raw::barrier(g).wait();
  });
  const auto paths = dump_flight_recorder("test");
  EXPECT_EQ(paths.size(), 2u);
  std::vector<std::string> problems;
  const auto dumps = trace::read_dumps(dir.str(), problems);
  EXPECT_THAT(problems, ::testing::IsEmpty());
  ASSERT_EQ(dumps.size(), 2u);
  const std::vector<std::string> expected = {"all_reduce #0 float32[3]", "all_reduce #1 float32[3]",
                                             "all_reduce #2 float32[3]", "all_gather #3 float64[2, 2]",
                                             "all_reduce #4 float32[5]", "barrier #5"};
  size_t total = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(dumps[r].rank, r);
    EXPECT_EQ(dumps[r].reason, "test");
    // The ring holds the process's newest records: of each rank, its newest.
    const auto mine = on_group(dumps[r], {0, 1});
    total += mine.size();
    for (size_t i = 0; i < mine.size(); ++i) {
      const auto& e = mine[i];
      ASSERT_EQ(e.seq, expected.size() - mine.size() + i) << "rank " << r;
      EXPECT_EQ(e.describe(), expected[e.seq]);
      EXPECT_EQ(e.group, "world");
      EXPECT_EQ(e.state, "finished") << e.describe();
      EXPECT_TRUE(e.finished_us && *e.finished_us >= e.queued_us) << e.describe();
    }
  }
  EXPECT_EQ(total, static_cast<size_t>(std::min<int64_t>(12, ring_size())));
  EXPECT_THAT(trace::diagnose(dumps).back(), HasSubstr("no collective is stuck"));
}

// Rank 1 skips one all_reduce on the world and goes on to a metric on a
// second group: every rank times out, dumps by itself, and the diagnosis
// names rank 1, where it is, and what the others wait in.
TEST(FlightRecorderTest, TimeoutDumpsAndTheDiagnosisNamesTheRankThatSkipped) {
  if (ring_size() < 16) GTEST_SKIP() << "needs the default ring";
  TraceDir dir("timeout");
  std::mutex mutex;
  std::vector<std::string> errors;
  spawn_ranks(
      3,
      [&](Group& g) {
        auto metrics = new_group({0, 1, 2}, NewGroupOptions().name("metrics"));
        try {
          for (int step = 0; step < 2; ++step) {
            if (!(step == 1 && g.rank() == 1)) ops::all_reduce(at::ones({8}), {}, g);
            ops::all_reduce(at::ones({1}), {}, metrics);
          }
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mutex);
          errors.push_back(e.what());
        }
      },
      testing::SpawnOptions().timeout(std::chrono::seconds(2)));
  EXPECT_EQ(errors.size(), 3u);
  std::vector<std::string> problems;
  const auto dumps = trace::read_dumps(dir.str(), problems);
  ASSERT_EQ(dumps.size(), 3u);
  EXPECT_THAT(dumps[1].reason, HasSubstr("timeout: all_reduce #1 on group 'metrics'"));
  std::string report;
  for (const auto& line : trace::diagnose(dumps)) report += line + "\n";
  EXPECT_THAT(report, HasSubstr("group 'world' (ranks [0, 1, 2]) is stuck at collective #1:"));
  EXPECT_THAT(report, HasSubstr("ranks [0, 2] are in all_reduce #1 float32[8] (timed_out"));
  EXPECT_THAT(report, HasSubstr("rank 1 is behind on group 'world': ranks [0, 2] wait in all_reduce #1 float32[8], "
                                "which rank 1 never called; it is in all_reduce #1 float32[1] on group 'metrics'"));
  EXPECT_THAT(report, HasSubstr("rank 1 went ahead into all_reduce #1 float32[1] on group 'metrics', which ranks "
                                "[0, 2] never reached"));
}

// SIGUSR2 makes the helper thread write every rank's record; a signal name
// it does not know is an error that names the variable.
TEST(FlightRecorderTest, SignalDumpsAndAnUnknownSignalIsAnError) {
  TraceDir dir("signal");
  ::setenv("COMMGRAD_TRACE_SIGNAL", "HUP-ish", 1);
  EXPECT_THAT(testing::error_of([] { install_flight_recorder_signal(); }),
              HasSubstr("COMMGRAD_TRACE_SIGNAL='HUP-ish' is not a signal (expected USR2, USR1, a number, or 0"));
  ::unsetenv("COMMGRAD_TRACE_SIGNAL");
  install_flight_recorder_signal();
  spawn_ranks(1, [](Group& g) { ops::all_reduce(at::ones({2}), {}, g); });
  ASSERT_EQ(std::raise(SIGUSR2), 0);
  const auto path = std::filesystem::path(dir.str()) / "rank_0.json";
  for (int i = 0; i < 200 && !std::filesystem::exists(path); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::vector<std::string> problems;
  const auto dumps = trace::read_dumps(dir.str(), problems);
  ASSERT_FALSE(dumps.empty()) << "no dump 10 s after SIGUSR2";
  EXPECT_EQ(dumps[0].rank, 0);  // (and the ranks of earlier tests in this process)
  EXPECT_EQ(dumps[0].reason, "signal");
  EXPECT_EQ(dumps[0].entries.back().describe(), "all_reduce #0 float32[2]");
}

}  // namespace
}  // namespace commgrad
