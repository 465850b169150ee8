// The program of docs/getting-started.md, as the guide runs it: 8 steps on
// one rank (saved); 4 steps at TP=2 x DP=2 (saved), resumed to step 8 at
// TP=1 x DP=4 and at TP=4 x DP=1, each checking its weights against the
// one-rank run's (the program exits 1 when they differ by more than 1e-5).
// And the code the other pages quote runs at 2 ranks: README.md's program
// (examples/snippets/readme_all_reduce.cpp; x.grad = [2, 2, 2, 2] on both
// ranks) and examples/snippets/doc_snippets.cpp (which checks its results
// against one rank and exits 1 when they differ).

#include "harness/subprocess.h"
#include "harness/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

ProcessResult run(int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {launcher_path(), "-n",  std::to_string(ranks),
                                   "--timeout",     "120", build_path("bin/getting_started")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, clean_env(), std::chrono::seconds(180));
}

TEST(GettingStarted, ResumedAtOtherLayoutsMatchesOneRank) {
  TempRoot one("one-rank"), half("half-way");
  auto r = run(1, {"--steps", "8", "--save", one.str()});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  r = run(4, {"--tp", "2", "--steps", "4", "--save", half.str()});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* tp : {"1", "4"}) {
    SCOPED_TRACE(std::string("resumed at TP=") + tp);
    r = run(4, {"--tp", tp, "--steps", "8", "--resume", half.str(), "--check", one.str()});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("[0] largest difference from one rank: "));
  }
  // The whole run at TP=2 x DP=2 follows it too.
  r = run(4, {"--tp", "2", "--steps", "8", "--check", one.str()});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

TEST(DocSnippets, RunAtTwoRanks) {
  TempRoot root("doc-snippets");
  auto r = run_process({launcher_path(), "-n", "2", "--timeout", "120", build_path("bin/doc_snippets"), root.str()},
                       clean_env(), std::chrono::seconds(180));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] loaded step 1, epoch 2"));
  EXPECT_THAT(r.out, HasSubstr("[1] resumed at step 1, epoch 3"));
  EXPECT_THAT(r.out, HasSubstr("[0] commgrad::check tp=2 float32"));  // docs/semantics.md: the table
}

TEST(DocSnippets, ReadmeProgramAtTwoRanks) {
  auto r = run_process({launcher_path(), "-n", "2", "--timeout", "120", build_path("bin/readme_all_reduce")},
                       clean_env(), std::chrono::seconds(180));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[0] tensor([2., 2., 2., 2.])"));
  EXPECT_THAT(r.out, HasSubstr("[1] tensor([2., 2., 2., 2.])"));
}

}  // namespace
}  // namespace commgrad::testing
