// Groups that span "hosts": ranks started by hand on this machine with
// COMMGRAD_HOST set per rank, in layouts with equal and unequal numbers of
// ranks per host. auto picks the hierarchical transport (shm inside a host,
// Gloo between hosts) and every collective gives the closed-form result
// (tests/dist/hierarchy_job.cpp).

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace commgrad::testing {
namespace {

// Starts one process per rank: layout[h] ranks on host h.
ProcessResult run_layout(const std::vector<int>& layout) {
  int world = 0;
  for (int k : layout) world += k;
  std::string script = "fail=0; pids=";
  int rank = 0;
  for (size_t h = 0; h < layout.size(); ++h) {
    for (int l = 0; l < layout[h]; ++l, ++rank) {
      script += "; RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world) +
                " LOCAL_RANK=" + std::to_string(l) + " LOCAL_WORLD_SIZE=" + std::to_string(layout[h]) +
                " COMMGRAD_HOST=host" + std::to_string(h) + " \"$JOB\" 2>&1 | sed 's/^/[" + std::to_string(rank) +
                "] /' & pids=\"$pids $!\"";
    }
  }
  script += "; for p in $pids; do wait $p || fail=1; done; exit $fail";
  return run_process({"bash", "-o", "pipefail", "-c", script},
                     clean_env({{"JOB", build_path("tests/dist/hierarchy_job")},
                                {"MASTER_ADDR", "127.0.0.1"},
                                {"MASTER_PORT", std::to_string(free_port())},
                                {"COMMGRAD_TIMEOUT", "30"}}),
                     std::chrono::seconds(120));
}

class HierarchyLayouts : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(HierarchyLayouts, EveryCollectiveMatchesItsClosedForm) {
  const auto& layout = GetParam();
  const auto r = run_layout(layout);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  int world = 0;
  bool several_per_host = false;
  for (int k : layout) {
    world += k;
    several_per_host = several_per_host || k > 1;
  }
  const std::string transport = layout.size() == 1 ? "shm" : several_per_host ? "hierarchical" : "gloo";
  for (int q = 0; q < world; ++q) {
    EXPECT_THAT(r.out, ::testing::HasSubstr("rank " + std::to_string(q) + " ok (" + transport)) << r.out;
  }
  if (layout == std::vector<int>{2, 2}) {
    EXPECT_THAT(r.out, ::testing::HasSubstr("parallel state: tp 0/2 (shm) pp 0/1 (shm) dp 0/2 (gloo) (world 4, "
                                            "hierarchical)"))
        << r.out;
  }
}

std::string layout_name(const ::testing::TestParamInfo<std::vector<int>>& info) {
  std::string name = "hosts";
  for (int k : info.param) name += "_" + std::to_string(k);
  return name;
}

INSTANTIATE_TEST_SUITE_P(Layouts, HierarchyLayouts,
                         ::testing::Values(std::vector<int>{2, 2}, std::vector<int>{1, 3}, std::vector<int>{3, 1, 2},
                                           std::vector<int>{1, 1}),
                         layout_name);

}  // namespace
}  // namespace commgrad::testing
