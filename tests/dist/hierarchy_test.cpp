// Groups that span "hosts": ranks started by hand on this machine with
// COMMGRAD_HOST set per rank, in layouts with equal and unequal numbers of
// ranks per host, and with hosts whose ranks interleave (0 and 2 on one, 1
// and 3 on the other). auto picks the hierarchical transport (shm inside a
// host, Gloo between hosts) and every collective gives the closed-form result
// or that of a flat Gloo group (tests/dist/hierarchy_job.cpp).

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace commgrad::testing {
namespace {

// Ranks per host, hosts in the order of their first rank.
std::vector<int> ranks_per_host(const std::vector<int>& host_of_rank) {
  std::vector<int> layout;
  for (int h : host_of_rank) {
    if (h >= static_cast<int>(layout.size())) layout.resize(h + 1, 0);
    ++layout[h];
  }
  return layout;
}

// Starts one process per rank: rank q on host host_of_rank[q].
ProcessResult run_layout(const std::vector<int>& host_of_rank) {
  return run_on_hosts(host_of_rank, build_path("tests/dist/hierarchy_job"), "", {{"COMMGRAD_TIMEOUT", "30"}});
}

class HierarchyLayouts : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(HierarchyLayouts, EveryCollectiveMatchesItsClosedForm) {
  const auto r = run_layout(GetParam());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto layout = ranks_per_host(GetParam());
  const int world = static_cast<int>(GetParam().size());
  bool several_per_host = false;
  for (int k : layout) several_per_host = several_per_host || k > 1;
  const std::string transport = layout.size() == 1 ? "shm" : several_per_host ? "hierarchical" : "gloo";
  for (int q = 0; q < world; ++q) {
    EXPECT_THAT(r.out, ::testing::HasSubstr("rank " + std::to_string(q) + " ok (" + transport)) << r.out;
  }
  if (GetParam() == std::vector<int>{0, 0, 1, 1}) {
    EXPECT_THAT(r.out, ::testing::HasSubstr("parallel state: tp 0/2 (shm) pp 0/1 (shm) dp 0/2 (gloo) (world 4, "
                                            "hierarchical)"))
        << r.out;
  }
}

// "hosts_AABB": ranks 0 and 1 on host A, 2 and 3 on host B.
std::string layout_name(const ::testing::TestParamInfo<std::vector<int>>& info) {
  std::string name = "hosts_";
  for (int h : info.param) name += static_cast<char>('A' + h);
  return name;
}

INSTANTIATE_TEST_SUITE_P(Layouts, HierarchyLayouts,
                         ::testing::Values(std::vector<int>{0, 0, 1, 1},        // 2 + 2
                                           std::vector<int>{0, 1, 1},           // 1 + 2
                                           std::vector<int>{0, 1, 1, 1},        // 1 + 3
                                           std::vector<int>{0, 0, 0, 1},        // 3 + 1
                                           std::vector<int>{0, 0, 1, 2},        // 2 + 1 + 1
                                           std::vector<int>{0, 0, 0, 1, 2, 2},  // 3 + 1 + 2
                                           std::vector<int>{0, 1, 0, 1},        // interleaved 2 + 2
                                           std::vector<int>{0, 1, 0, 0, 2, 1},  // interleaved 3 + 2 + 1
                                           std::vector<int>{0, 1}),             // 1 + 1 (flat Gloo)
                         layout_name);

}  // namespace
}  // namespace commgrad::testing
