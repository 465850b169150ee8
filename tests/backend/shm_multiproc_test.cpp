// The shm backend as real processes under commgrad-run: collectives and
// point-to-point across processes, selection by name, by "auto" and by
// COMMGRAD_BACKEND for an unchanged program (the founding example), and a
// rank killed with SIGKILL in the middle of a collective: the others fail
// with an error naming it within the timeout, the launcher reports it, and
// /dev/shm holds nothing of the job afterwards. The single-copy all-reduce
// (ranks read each other's tensors) across processes, its fallback when a
// rank may not be read, and a rank killed in the middle of it.

#include "harness/subprocess.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <signal.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace commgrad::testing {
namespace {

std::string job() { return build_path("tests/backend/shm_job"); }

// "[q] rank q": how the launcher prefixes what rank q of shm_job prints.
std::string rank_says(int q) {
  std::string s = "[";
  s += std::to_string(q);
  s += "] rank ";
  s += std::to_string(q);
  return s;
}

// Environment without launcher variables, with a short timeout.
std::map<std::string, std::string> shm_env(std::map<std::string, std::string> extra = {}) {
  extra.emplace("COMMGRAD_SHM_CHUNK_BYTES", "");
  extra.emplace("COMMGRAD_TIMEOUT", "30");
  return clean_env(extra);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string segment_of(const std::string& out) {
  const auto lines = lines_with_prefix(out, "[0] segment ");
  return lines.empty() ? "" : lines[0].substr(std::string("[0] segment ").size());
}

class ShmJob : public ::testing::TestWithParam<int> {};

TEST_P(ShmJob, CollectivesAndMessagesAcrossProcesses) {
  const int n = GetParam();
  auto r = run_process({launcher_path(), "-n", std::to_string(n), "--timeout", "90", job(), "ops", "shm"}, shm_env());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int q = 0; q < n; ++q) {
    EXPECT_TRUE(contains(r.out, rank_says(q) + " ok (shm)")) << r.out;
  }
  const std::string segment = segment_of(r.out);
  ASSERT_FALSE(segment.empty()) << r.out;
  EXPECT_NE(access(("/dev/shm" + segment).c_str(), F_OK), 0) << segment << " is still in /dev/shm";
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmJob, ::testing::Values(1, 2, 4));

// Whether a process may read a sibling's memory on this machine (what the
// ranks of a shm group probe among themselves: Yama, seccomp or a
// container may forbid it).
bool siblings_may_read_each_other() {
  static const uint64_t word = 0x5eed;
  const pid_t sleeper = fork();
  if (sleeper == 0) {
    pause();
    _exit(0);
  }
  const pid_t reader = fork();
  if (reader == 0) {
    uint64_t value = 0;
    iovec mine{&value, sizeof(value)};
    iovec theirs{const_cast<uint64_t*>(&word), sizeof(word)};
    _exit(process_vm_readv(sleeper, &mine, 1, &theirs, 1, 0) == sizeof(value) && value == word ? 0 : 1);
  }
  int status = 0;
  waitpid(reader, &status, 0);
  kill(sleeper, SIGKILL);
  waitpid(sleeper, nullptr, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// All-reduces from 1 MiB and all-to-all pieces from 64 KiB on read the
// peers' tensors (on 3 ranks and 2 cores the defaults would stage them).
std::map<std::string, std::string> single_copy_env() {
  return shm_env({{"COMMGRAD_SHM_SINGLE_COPY_BYTES", "1048576"}, {"COMMGRAD_SHM_SINGLE_COPY_PIECE_BYTES", "65536"}});
}

// Where the machine lets siblings read each other, the group does, and
// the results are exact; where it does not, the group stages, as exactly.
TEST(ShmSingleCopy, AllreducesReadThePeersAcrossProcesses) {
  const std::string expected = siblings_may_read_each_other() ? "on" : "off";
  auto r = run_process({launcher_path(), "-n", "3", "--timeout", "90", job(), "single-copy"}, single_copy_env());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int q = 0; q < 3; ++q) {
    const std::string p = rank_says(q);
    EXPECT_TRUE(contains(r.out, p + " single copy " + expected + ", direct pieces " + expected)) << r.out;
    EXPECT_TRUE(contains(r.out, p + " ok")) << r.out;
  }
}

// Rank 1 may not be read (not dumpable; no rank has CAP_SYS_PTRACE), while
// it may read the others: the ranks disagree in their probes, and the group
// agrees to stage on every rank; the results are exact.
TEST(ShmSingleCopy, FallsBackToStagingWhenARankCannotBeRead) {
  auto r = run_process({launcher_path(), "-n", "3", "--timeout", "90", job(), "single-copy", "unreadable"},
                       single_copy_env());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_FALSE(contains(r.err, "capset failed")) << r.err;
  for (int q = 0; q < 3; ++q) {
    const std::string p = rank_says(q);
    EXPECT_TRUE(contains(r.out, p + " single copy off, direct pieces off")) << r.out;
    EXPECT_TRUE(contains(r.out, p + " ok")) << r.out;
  }
}

TEST(ShmSelection, AutoPicksShmWhenEveryRankIsOnThisHost) {
  auto r = run_process({launcher_path(), "-n", "3", "--timeout", "90", job(), "ops", "auto"}, shm_env());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[2] rank 2 ok (shm)")) << r.out;
}

TEST(ShmSelection, CommgradBackendSelectsTheTransportOfTheFoundingExample) {
  const std::string example = build_path("bin/tp_autograd_comm");
  if (access(example.c_str(), X_OK) != 0) GTEST_SKIP() << "examples are not built";
  for (const std::string backend : {"shm", "gloo"}) {
    auto r =
        run_process({launcher_path(), "-n", "4", "--timeout", "90", example}, shm_env({{"COMMGRAD_BACKEND", backend}}));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_TRUE(contains(r.out, "[0] world: 4 ranks, backend " + backend)) << r.out;
    EXPECT_TRUE(contains(r.out, "[0] x.grad = tensor([4., 4., 4., 4.])")) << r.out;
  }
}

TEST(ShmFailure, KillNineOfARankMidCollectiveIsReportedAndLeavesNothingBehind) {
  auto r = run_process({launcher_path(), "-n", "3", "--grace", "15", "--timeout", "90", job(), "kill"}, shm_env(),
                       std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 128 + 9) << r.out << r.err;
  // Both survivors name the dead rank, and fail well within the 30 s timeout.
  for (int q : {0, 2}) {
    const auto lines = lines_with_prefix(r.err, rank_says(q) + " failed after ");
    ASSERT_EQ(lines.size(), 1u) << r.err;
    EXPECT_TRUE(contains(lines[0], "rank 1 (pid ")) << lines[0];
    EXPECT_TRUE(contains(lines[0], "died")) << lines[0];
    const double after = std::stod(lines[0].substr(lines[0].find("after ") + 6));
    EXPECT_LT(after, 10.0) << lines[0];
  }
  EXPECT_TRUE(contains(r.err, "SIGKILL")) << "the launcher did not report the killed rank\n" << r.err;
  const std::string segment = segment_of(r.out);
  ASSERT_FALSE(segment.empty()) << r.out;
  EXPECT_NE(access(("/dev/shm" + segment).c_str(), F_OK), 0) << segment << " was left in /dev/shm";
}

// Killed in the middle of single-copy all-reduces (a peer may be reading
// its tensor at that moment: process_vm_readv fails, or the peer waits at a
// step's barrier): the survivor names it within seconds.
TEST(ShmFailure, KillNineOfARankMidSingleCopyAllreduceIsReported) {
  if (!siblings_may_read_each_other()) GTEST_SKIP() << "processes may not read each other here: no single copy";
  auto r = run_process({launcher_path(), "-n", "2", "--grace", "15", "--timeout", "90", job(), "kill"},
                       single_copy_env(), std::chrono::seconds(120));
  // process_vm_readv fails as soon as the killed rank drops its memory,
  // before it is a zombie: the survivor may exit (code 3) before the
  // launcher sees the SIGKILL, and then its exit is the verdict.
  EXPECT_TRUE(r.exit_code == 128 + 9 || r.exit_code == 3) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "[0] single copy on")) << r.out;
  const auto lines = lines_with_prefix(r.err, "[0] rank 0 failed after ");
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_TRUE(contains(lines[0], "rank 1 (pid ") || contains(lines[0], "rank 1's tensor")) << lines[0];
  EXPECT_TRUE(contains(lines[0], "died") || contains(lines[0], "the process is gone")) << lines[0];
  EXPECT_LT(std::stod(lines[0].substr(lines[0].find("after ") + 6)), 10.0) << lines[0];
}

// Through ops::all_reduce the error has one prefix and one collective number
// (the collective's number in its group), not the transport's as well.
TEST(ShmFailure, KilledRankDuringOpsNamesOneCollectiveNumber) {
  auto r = run_process({launcher_path(), "-n", "3", "--grace", "15", "--timeout", "90", job(), "kill", "ops"},
                       shm_env(), std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 128 + 9) << r.out << r.err;
  for (int q : {0, 2}) {
    const auto lines = lines_with_prefix(r.err, rank_says(q) + " failed after ");
    ASSERT_EQ(lines.size(), 1u) << r.err;
    const std::string& line = lines[0];
    EXPECT_TRUE(contains(line, "rank 1 (pid ")) << line;
    EXPECT_TRUE(
        contains(line, "[commgrad] all_reduce rank " + std::to_string(q) + "/3 group 'world' (shm): collective #"))
        << line;
    auto count = [&](const std::string& part) {
      size_t n = 0;
      for (auto at = line.find(part); at != std::string::npos; at = line.find(part, at + 1)) ++n;
      return n;
    };
    EXPECT_EQ(count("collective #"), 1u) << line;
    EXPECT_EQ(count("[commgrad]"), 1u) << line;
  }
}

// What /dev/shm holds of the job `id` (its segments are named after it).
std::vector<std::string> segments_of_job(const std::string& id) {
  std::vector<std::string> found;
  const std::string prefix = "commgrad-shm-" + id + "-";
  if (DIR* dir = opendir("/dev/shm")) {
    while (const dirent* e = readdir(dir)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) found.push_back(e->d_name);
    }
    closedir(dir);
  }
  return found;
}

// A rank started with another COMMGRAD_SHM_CHUNK_BYTES: rank 0 names the
// mismatch at once (not "within the timeout"), and nothing is left in /dev/shm.
TEST(ShmSetupFailure, ARankWithOtherSettingsIsNamedAtOnceAndLeavesNothingBehind) {
  const std::string id = "shm_mismatch_" + std::to_string(getpid());
  auto r = run_process({launcher_path(), "-n", "2", "--rdzv-id", id, "--timeout", "90", job(), "mismatch"}, shm_env(),
                       std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "[1] rank 1 setup failed: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "all ranks must use the same")) << r.err;
  const auto rank0 = lines_with_prefix(r.err, "[0] rank 0 setup failed: ");
  if (!rank0.empty()) {  // unless the launcher stopped it first
    EXPECT_TRUE(contains(rank0[0], "a peer could not join the shared-memory segment")) << rank0[0];
    EXPECT_FALSE(contains(rank0[0], "within")) << rank0[0];
  }
  EXPECT_LT(r.seconds, 20);
  EXPECT_TRUE(segments_of_job(id).empty()) << "left in /dev/shm: " << segments_of_job(id)[0];
}

// A rank killed while the group is being set up (rank 0 waiting for it to
// map the segment): nothing is left in /dev/shm. The rank's watcher thread
// races its own setup; on a loaded machine the setup sometimes wins (the
// job then says "the group was set up"), and the job runs again.
TEST(ShmSetupFailure, ARankKilledDuringSetupLeavesNothingBehind) {
  std::string id;
  ProcessResult r;
  for (int attempt = 0; attempt < 10; ++attempt) {
    id = "shm_die_" + std::to_string(getpid()) + "_" + std::to_string(attempt);
    r = run_process({launcher_path(), "-n", "2", "--rdzv-id", id, "--timeout", "90", job(), "die"}, shm_env(),
                    std::chrono::seconds(120));
    if (!contains(r.err, "the group was set up")) break;
  }
  ASSERT_FALSE(contains(r.err, "the group was set up")) << "the kill never came before the setup ended: " << r.err;
  EXPECT_EQ(r.exit_code, 128 + 9) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "rank 1 (pid ")) << r.err;
  EXPECT_LT(r.seconds, 20);
  EXPECT_TRUE(segments_of_job(id).empty()) << "left in /dev/shm: " << segments_of_job(id)[0];
}

}  // namespace
}  // namespace commgrad::testing
