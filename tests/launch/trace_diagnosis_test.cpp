// commgrad-trace's diagnosis on hand-made records: the cases a real job
// rarely shows on demand (no majority, a rank without a dump, a record the
// ring dropped, a group made again under the same name). The cases a real
// job shows are tests/dist/flight_recorder*_test.cpp.

#include "diagnosis.h"
#include "dumps.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace commgrad::trace {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

Entry entry(const std::string& op, uint64_t seq, const std::string& state, std::vector<int> ranks = {0, 1, 2}) {
  Entry e;
  e.op = op;
  e.group = "world";
  e.ranks = std::move(ranks);
  e.seq = seq;
  e.dtype = "float32";
  e.sizes = {4};
  e.state = state;
  e.queued_us = 1000000;
  return e;
}

Dump dump(int rank, std::vector<Entry> entries) {
  Dump d;
  d.rank = rank;
  d.dumped_us = 4000000;
  d.entries = std::move(entries);
  return d;
}

std::string report(const std::vector<Dump>& dumps) {
  std::string out;
  for (const auto& line : diagnose(dumps)) out += line + "\n";
  return out;
}

TEST(TraceDiagnosisTest, TwoRanksThatDisagreeAreBothNamed) {
  const auto out = report(
      {dump(0, {entry("all_reduce", 0, "failed", {0, 1})}), dump(1, {entry("all_gather", 0, "failed", {0, 1})})});
  EXPECT_THAT(out, HasSubstr("rank 0 called all_reduce #0 float32[4] on group 'world' (the ranks disagree"));
  EXPECT_THAT(out, HasSubstr("rank 1 called all_gather #0 float32[4] on group 'world' (the ranks disagree"));
}

TEST(TraceDiagnosisTest, RankWithoutADumpAndARecordTheRingDroppedAreSaid) {
  const auto out = report({dump(0, {entry("all_reduce", 0, "finished"), entry("all_reduce", 1, "timed_out")}),
                           dump(1, {entry("all_reduce", 2, "finished")})});
  EXPECT_THAT(out, HasSubstr("ranks [0, 1, 2]) is stuck at collective #1:"));
  EXPECT_THAT(out, HasSubstr("rank 0 is in all_reduce #1 float32[4] (timed_out, 3.0 s after it was issued)"));
  EXPECT_THAT(out, HasSubstr("rank 1: its record of #1 was overwritten (raise COMMGRAD_TRACE_BUFFER_SIZE)"));
  EXPECT_THAT(out, HasSubstr("rank 2 left no dump"));
}

TEST(TraceDiagnosisTest, OnlyTheNewestGroupOfANameCounts) {
  // A group of the same name and ranks made again: its numbers start at 0.
  const auto first = entry("all_reduce", 0, "finished");
  const auto out = report({dump(0, {entry("all_reduce", 0, "finished"), entry("all_reduce", 1, "started"), first}),
                           dump(1, {entry("all_reduce", 0, "finished"), entry("all_reduce", 1, "started"), first}),
                           dump(2, {first})});
  EXPECT_THAT(out, HasSubstr("no collective is stuck"));
}

TEST(TraceDiagnosisTest, RankInNoCollectiveIsSaidToBeOutsideCommgrad) {
  const auto out = report({dump(0, {entry("all_reduce", 0, "finished"), entry("all_reduce", 1, "started")}),
                           dump(1, {entry("all_reduce", 0, "finished"), entry("all_reduce", 1, "started")}),
                           dump(2, {entry("all_reduce", 0, "finished")})});
  EXPECT_THAT(out, HasSubstr("rank 2 is behind on group 'world': ranks [0, 1] wait in all_reduce #1 float32[4], which "
                             "rank 2 never called; it is in no collective (computing, or stuck outside commgrad)"));
  EXPECT_THAT(out, Not(HasSubstr("went ahead")));
}

}  // namespace
}  // namespace commgrad::trace
