// Tests of commgrad-run: run the real binary ($COMMGRAD_RUN) on small
// /bin/sh programs and check its output, exit code, timing, and that no
// process it started outlives it. Each test tags its long-running processes
// with a unique `sleep 60.<digits>` so leftovers can be found in /proc.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "commgrad/config.h"
#include "launch/child_process.h"

namespace commgrad::testing {
namespace {

// Generous: the tests share two cores with whole builds.
constexpr double kRunLimitS = 30;
constexpr double kFastTeardownS = 10;
constexpr double kLeftoverWaitS = 3;

// $COMMGRAD_RUN, else the build tree's bin/, else the path this test was
// built with (ctest may pass only part of the environment list).
std::string launcher_path() {
  if (const char* path = std::getenv("COMMGRAD_RUN")) return path;
  if (const char* dir = std::getenv("COMMGRAD_BUILD_DIR")) {
    const std::string path = std::string(dir) + "/bin/commgrad-run";
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return COMMGRAD_RUN_PATH;
}

// A unique duration for `sleep`, e.g. "60.123450007": it finds the process.
std::string unique_marker() {
  static int counter = 0;
  return "60." + std::to_string(getpid()) + std::to_string(100 + counter++);
}

std::vector<std::string> launch_args(std::vector<std::string> args) {
  args.insert(args.begin(), launcher_path());
  return args;
}

// Runs commgrad-run with `args` to the end.
ChildResult launch(const std::vector<std::string>& args,
                   const std::map<std::string, std::optional<std::string>>& env = {}) {
  ChildProcess child(launch_args(args), env);
  return child.finish(kRunLimitS);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool has_line(const std::string& text, const std::string& line) {
  for (const std::string& l : lines_of(text))
    if (l == line) return true;
  return false;
}

// A temporary directory removed with everything in it at the end of a test.
class TempDir {
 public:
  TempDir() {
    char templ[] = "/tmp/commgrad_launch_XXXXXX";
    path_ = mkdtemp(templ);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

#define EXPECT_NO_LEFTOVERS(marker) \
  EXPECT_TRUE(leftovers(marker, kLeftoverWaitS).empty()) << "processes with " << (marker) << " remain"

TEST(LauncherTest, HelpMentionsEveryOption) {
  const ChildResult r = launch({"--help"});
  EXPECT_EQ(r.code, 0);
  for (const char* opt :
       {"-n,", "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--timeout", "--grace",
        "--no-prefix", "--help", "--version", "--max-restarts", "--rdzv-id"}) {
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt;
  }
  EXPECT_TRUE(r.err.empty()) << r.err;
}

TEST(LauncherTest, VersionNamesTheBuild) {
  const ChildResult r = launch({"--version"});
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, COMMGRAD_BUILD_INFO_STRING "\n");
  // The LibTorch found by CMake, its C++ standard, and the transports.
  EXPECT_NE(r.out.find("(LibTorch " COMMGRAD_TORCH_VERSION_STRING ", C++"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("transports: gloo shm"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("nccl") != std::string::npos, COMMGRAD_HAVE_NCCL == 1) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;
  EXPECT_EQ(launch({"--version=1"}).code, 2);
}

TEST(LauncherTest, BadUsageExitsTwo) {
  const std::vector<std::vector<std::string>> cases = {
      {},
      {"-n", "2"},
      {"--bogus", "true"},
      {"-n", "0", "true"},
      {"-n", "two", "true"},
      {"-n", "3x", "true"},
      {"--nproc-per-node"},
      {"--timeout", "soon", "true"},
      {"--timeout", "0", "true"},
      {"--grace", "-1", "true"},
      {"--master-port", "70000", "true"},
      {"--nnodes", "2", "true"},
      {"--nnodes", "2", "--master-addr", "127.0.0.1", "true"},
      {"--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--master-port", "29500", "true"},
      {"--node-rank", "1", "true"},
  };
  for (const auto& args : cases) {
    std::string joined;
    for (const auto& a : args) joined += " " + a;
    const ChildResult r = launch(args);
    EXPECT_EQ(r.code, 2) << joined;
    EXPECT_NE(r.err.find("commgrad-run: "), std::string::npos) << joined;
    EXPECT_NE(r.err.find("see commgrad-run --help"), std::string::npos) << joined;
    EXPECT_EQ(lines_of(r.err).size(), 2u) << joined << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << joined;
  }
}

// Each bad option is named in the error (the house rules of every program: tools/cli/cli.h).
TEST(LauncherTest, BadOptionsAreNamed) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--bogus", "true"}, "unknown option '--bogus'"},
      {{"-n", "2", "--bogus=1", "true"}, "unknown option '--bogus=1'"},
      {{"-n", "0", "true"}, "--nproc-per-node: expected an integer in [1, 1024], got '0'"},
      {{"-n", "two", "true"}, "--nproc-per-node: expected an integer in [1, 1024], got 'two'"},
      {{"--nproc-per-node=99999999999", "true"}, "--nproc-per-node: expected an integer in [1, 1024]"},
      {{"-n", "-1", "true"}, "--nproc-per-node: expected an integer in [1, 1024], got '-1'"},
      {{"--nproc-per-node"}, "--nproc-per-node: 1 required"},
      {{"--nnodes", "0", "true"}, "--nnodes: expected an integer in [1, "},
      {{"--node-rank", "-1", "true"}, "--node-rank: expected an integer in [0, "},
      {{"--master-port", "70000", "true"}, "--master-port: expected an integer in [1, 65535], got '70000'"},
      {{"--master-addr", "", "true"}, "--master-addr: expected an address"},
      {{"--timeout", "soon", "true"}, "--timeout: expected a number > 0"},
      {{"--grace", "-1", "true"}, "--grace: expected a number >= 0"},
      {{"--no-prefix=1", "true"}, "--no-prefix takes no value"},
      {{"--version=1"}, "--version takes no value"},
      {{"-n", "2"}, "missing the program to run"},
  };
  for (const auto& [args, message] : cases) {
    std::string joined;
    for (const auto& a : args) joined += " " + a;
    const ChildResult r = launch(args);
    EXPECT_EQ(r.code, 2) << joined;
    EXPECT_NE(r.err.find("commgrad-run: " + message), std::string::npos) << joined << ": " << r.err;
  }
  // torchrun's spellings and an option's value in the same word.
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--nproc-per-node", "2", "true"},
                                               {"--nproc-per-node=2", "true"},
                                               {"-n", "2", "true"},
                                               {"-n2", "true"},
                                               {"-n", "2", "--", "true"}}) {
    EXPECT_EQ(launch(args).code, 0) << args[0];
  }
}

TEST(LauncherTest, SetsTorchrunEnvironmentAndRemovesOtherLaunchers) {
  const ChildResult r = launch({"-n", "3", "sh", "-c",
                                "echo R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK "
                                "A=$MASTER_ADDR O=$OMP_NUM_THREADS "
                                "X=${OMPI_COMM_WORLD_RANK-unset},${OMPI_COMM_WORLD_SIZE-unset},"
                                "${SLURM_PROCID-unset},${SLURM_NTASKS-unset},${SLURM_LOCALID-unset} J=$SLURM_JOB_ID; "
                                "echo P=$MASTER_PORT"},
                               {{"OMPI_COMM_WORLD_RANK", "5"},
                                {"OMPI_COMM_WORLD_SIZE", "9"},
                                {"SLURM_PROCID", "4"},
                                {"SLURM_NTASKS", "8"},
                                {"SLURM_LOCALID", "1"},
                                {"SLURM_JOB_ID", "77"},
                                {"OMP_NUM_THREADS", std::nullopt},
                                {"RANK", "99"},
                                {"MASTER_PORT", "1"}});
  ASSERT_EQ(r.code, 0) << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string s = std::to_string(rank);
    EXPECT_TRUE(has_line(
        r.out, "[" + s + "] R=" + s + " W=3 L=" + s + " LW=3 G=0 A=127.0.0.1 O=1 X=unset,unset,unset,unset,unset J=77"))
        << r.out;
  }
  // One free port, the same for every rank.
  std::set<int> ports;
  for (const std::string& line : lines_of(r.out)) {
    int rank = -1;
    int port = -1;
    if (std::sscanf(line.c_str(), "[%d] P=%d", &rank, &port) == 2) ports.insert(port);
  }
  ASSERT_EQ(ports.size(), 1u) << r.out;
  const int port = *ports.begin();
  EXPECT_GT(port, 1);
  EXPECT_LE(port, 65535);
}

TEST(LauncherTest, KeepsOmpNumThreadsWhenSet) {
  const ChildResult r = launch({"-n", "2", "sh", "-c", "echo O=$OMP_NUM_THREADS"}, {{"OMP_NUM_THREADS", "4"}});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has_line(r.out, "[0] O=4")) << r.out;
  EXPECT_TRUE(has_line(r.out, "[1] O=4")) << r.out;
}

TEST(LauncherTest, MultiNodeRanksAreOffsetByNodeRank) {
  const ChildResult r = launch({"--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port",
                                "29555", "--nproc-per-node=2", "--", "sh", "-c",
                                "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK "
                                "$MASTER_ADDR $MASTER_PORT"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has_line(r.out, "[2] 2 4 0 2 1 10.1.2.3 29555")) << r.out;
  EXPECT_TRUE(has_line(r.out, "[3] 3 4 1 2 1 10.1.2.3 29555")) << r.out;
  EXPECT_EQ(lines_of(r.out).size(), 2u) << r.out;
}

TEST(LauncherTest, PrefixesStdoutAndStderrSeparately) {
  const ChildResult r =
      launch({"-n", "2", "sh", "-c", "printf 'out1\\nout2\\n'; printf 'err1\\n' >&2; printf \"tail-$RANK\""});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const std::string s : {"0", "1"}) {
    const std::string p = "[" + s + "] ";
    EXPECT_TRUE(has_line(r.out, p + "out1")) << r.out;
    EXPECT_TRUE(has_line(r.out, p + "tail-" + s)) << r.out;  // unterminated, flushed at EOF
    EXPECT_LT(r.out.find(p + "out1"), r.out.find(p + "out2"));
    EXPECT_TRUE(has_line(r.err, p + "err1")) << r.err;
  }
  EXPECT_EQ(r.out.find("err1"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("out1"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.back(), '\n');
  EXPECT_EQ(lines_of(r.out).size(), 6u) << r.out;
}

TEST(LauncherTest, NoPrefixPassesOutputThrough) {
  const ChildResult r = launch({"--no-prefix", "sh", "-c", "printf 'a\\nb'; printf 'e\\n' >&2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "a\nb");
  EXPECT_EQ(r.err, "e\n");
}

TEST(LauncherTest, ConcurrentLinesNeverInterleave) {
  // Four ranks writing long lines at once, each through many small writes.
  const ChildResult r = launch({"-n", "4", "sh", "-c",
                                "i=0; while [ $i -lt 400 ]; do printf 'rank %s ' $RANK; printf 'line %s ' $i; "
                                "printf 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\\n'; "
                                "i=$((i+1)); done"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::map<int, int> next_line;
  for (const std::string& line : lines_of(r.out)) {
    int prefix = -1;
    int rank = -1;
    int index = -1;
    int used = 0;
    ASSERT_EQ(std::sscanf(line.c_str(), "[%d] rank %d line %d %n", &prefix, &rank, &index, &used), 3)
        << "mangled line: " << line;
    ASSERT_EQ(line.substr(static_cast<std::size_t>(used)), std::string(62, 'x')) << line;
    ASSERT_EQ(prefix, rank) << line;
    EXPECT_EQ(index, next_line[rank]++) << line;  // per-rank order kept
  }
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(next_line[rank], 400) << rank;
}

TEST(LauncherTest, AllRanksSucceedExitsZero) {
  const ChildResult r = launch({"-n", "4", "true"});
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(r.err.empty()) << r.err;
}

TEST(LauncherTest, PropagatesFirstFailureAndStopsOthersFast) {
  const std::string marker = unique_marker();
  const ChildResult r =
      launch({"-n", "4", "sh", "-c", "if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; sleep " + marker});
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("commgrad-run: rank 1 (pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(") exited with code 3; stopping the other 3 ranks"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, kFastTeardownS);
  EXPECT_NO_LEFTOVERS(marker);
}

// Every rank prints 37 lines through buffered stdio (stdout a pipe here, as
// a cluster's log is) and returns 1 at about the same time: the launcher
// stops the others when the first exits, and their lines must not be lost
// (they were in 2 of 8 runs before ranks under commgrad-run line-buffered stdout).
TEST(LauncherTest, RanksThatAllFailKeepEveryPrintedLine) {
  for (int run = 0; run < 8; ++run) {
    const ChildResult r = launch({"-n", "4", ALL_FAIL_JOB_PATH});
    EXPECT_EQ(r.code, 1) << r.err;
    for (int rank = 0; rank < 4; ++rank) {
      for (int line : {0, 36}) {
        const std::string want = "rank " + std::to_string(rank) + " line " + std::to_string(line) + "\n";
        EXPECT_NE(r.out.find(want), std::string::npos) << "run " << run << ": no '" << want << "' in\n" << r.out;
      }
    }
  }
}

TEST(LauncherTest, ReportsRankKilledBySignal) {
  const std::string marker = unique_marker();
  const ChildResult r = launch({"-n", "2", "sh", "-c", "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep " + marker});
  EXPECT_EQ(r.code, 137) << r.err;
  EXPECT_NE(r.err.find("rank 1 (pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("was killed by signal SIGKILL (9)"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, kFastTeardownS);
  EXPECT_NO_LEFTOVERS(marker);
}

// A killed rank's peers fail because of it, and the launcher may find both
// exits at once. Here rank 0 stops the launcher, SIGKILLs rank 1, waits for it
// to be a zombie, lets a helper resume the launcher, and exits 3 itself: the
// launcher sees the two exits together (the older child first) and must still
// name the killed rank as the cause.
TEST(LauncherTest, AKilledRankIsTheVerdictWhenItsPeerFailedAtTheSameTime) {
  const std::string marker = unique_marker();
  TempDir dir;
  const std::string pid_file = dir.path() + "/pid1";
  const ChildResult r = launch({"-n", "2", "sh", "-c",
                                "if [ $RANK = 1 ]; then echo $$ > " + pid_file + ".tmp; mv " + pid_file + ".tmp " +
                                    pid_file + "; sleep " + marker +
                                    "; exit 0; fi; "
                                    "while [ ! -e " +
                                    pid_file + " ]; do sleep 0.02; done; p=$(cat " + pid_file +
                                    "); "
                                    "kill -STOP $PPID; kill -9 $p; "
                                    "while ! grep -q ') Z' /proc/$p/stat; do sleep 0.01; done; "
                                    "(sleep 0.3; kill -CONT $PPID) & exit 3"});
  EXPECT_EQ(r.code, 137) << r.err;
  EXPECT_NE(r.err.find("rank 1 (pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("was killed by signal SIGKILL (9)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("exited with code 3"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, kFastTeardownS);
  EXPECT_NO_LEFTOVERS(marker);
}

TEST(LauncherTest, SigkillsRankThatIgnoresSigtermAfterGrace) {
  const std::string marker = unique_marker();
  TempDir dir;
  // Rank 0 fails only once rank 1 ignores SIGTERM (which its sleep inherits).
  const ChildResult r = launch({"-n", "2", "--grace", "1", "sh", "-c",
                                "if [ $RANK = 0 ]; then while [ ! -e " + dir.path() +
                                    "/ready ]; do sleep 0.02; done; "
                                    "exit 5; fi; trap '' TERM; touch " +
                                    dir.path() + "/ready; sleep " + marker});
  EXPECT_EQ(r.code, 5) << r.err;
  EXPECT_NE(r.err.find("rank 0 (pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("1 rank still running 1s after being told to stop; sending SIGKILL"), std::string::npos)
      << r.err;
  EXPECT_GE(r.seconds, 1.0);
  EXPECT_LT(r.seconds, kFastTeardownS);
  EXPECT_NO_LEFTOVERS(marker);
}

// Ranks trap `sig`, print a marker when they get it, and exit 0.
void expect_signal_forwarded(int sig, const std::string& trap_name, int expected_code) {
  const std::string marker = unique_marker();
  ChildProcess child(launch_args(
      {"-n", "2", "sh", "-c",
       "trap 'echo got-" + trap_name + "-$RANK; exit 0' " + trap_name + "; echo ready; sleep " + marker + " & wait"}));
  ASSERT_TRUE(child.wait_for_stdout({"[0] ready", "[1] ready"}, kRunLimitS)) << child.err();
  child.send(sig);
  const ChildResult r = child.finish(kRunLimitS);
  EXPECT_EQ(r.code, expected_code) << r.err;
  EXPECT_TRUE(has_line(r.out, "[0] got-" + trap_name + "-0")) << r.out;
  EXPECT_TRUE(has_line(r.out, "[1] got-" + trap_name + "-1")) << r.out;
  EXPECT_NE(r.err.find("received SIG" + trap_name + "; forwarding it to 2 ranks"), std::string::npos) << r.err;
  EXPECT_NO_LEFTOVERS(marker);
}

TEST(LauncherTest, ForwardsSigtermToRanks) { expect_signal_forwarded(SIGTERM, "TERM", 143); }

TEST(LauncherTest, ForwardsSigintToRanks) { expect_signal_forwarded(SIGINT, "INT", 130); }

TEST(LauncherTest, ForwardedSignalEscalatesToSigkill) {
  const std::string marker = unique_marker();
  ChildProcess child(
      launch_args({"-n", "2", "--grace", "0.5", "sh", "-c", "trap '' HUP; echo ready; sleep " + marker}));
  ASSERT_TRUE(child.wait_for_stdout({"[0] ready", "[1] ready"}, kRunLimitS)) << child.err();
  child.send(SIGHUP);
  const ChildResult r = child.finish(kRunLimitS);
  EXPECT_EQ(r.code, 128 + SIGHUP) << r.err;
  EXPECT_NE(r.err.find("sending SIGKILL"), std::string::npos) << r.err;
  EXPECT_NO_LEFTOVERS(marker);
}

TEST(LauncherTest, SecondSignalSkipsTheGracePeriod) {
  const std::string marker = unique_marker();
  ChildProcess child(launch_args({"-n", "2", "--grace", "60", "sh", "-c", "trap '' INT; echo ready; sleep " + marker}));
  ASSERT_TRUE(child.wait_for_stdout({"[0] ready", "[1] ready"}, kRunLimitS)) << child.err();
  child.send(SIGINT);
  ASSERT_TRUE(child.wait_for_stderr({"forwarding it to 2 ranks"}, kRunLimitS)) << child.err();
  child.send(SIGINT);
  const ChildResult r = child.finish(kRunLimitS);
  EXPECT_EQ(r.code, 130) << r.err;
  EXPECT_NE(r.err.find("received SIGINT while stopping; sending SIGKILL to 2 ranks"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, kFastTeardownS);
  EXPECT_NO_LEFTOVERS(marker);
}

TEST(LauncherTest, TimeoutStopsJobWith124) {
  const std::string marker = unique_marker();
  const ChildResult r = launch({"-n", "2", "--timeout", "1", "sleep", marker});
  EXPECT_EQ(r.code, 124) << r.err;
  EXPECT_NE(r.err.find("commgrad-run: job exceeded --timeout 1s; stopping 2 ranks"), std::string::npos) << r.err;
  EXPECT_GE(r.seconds, 1.0);
  EXPECT_LT(r.seconds, kFastTeardownS);
  EXPECT_NO_LEFTOVERS(marker);
}

TEST(LauncherTest, ProgramNotFoundExits127BeforeStarting) {
  const ChildResult r = launch({"-n", "2", "commgrad-no-such-program-xyz"});
  EXPECT_EQ(r.code, 127);
  EXPECT_EQ(r.err, "commgrad-run: cannot execute 'commgrad-no-such-program-xyz': not found in PATH\n");
  EXPECT_TRUE(r.out.empty());
}

TEST(LauncherTest, ProgramNotExecutableExits126) {
  TempDir dir;
  const std::string file = dir.path() + "/not_executable";
  std::ofstream(file) << "echo hi\n";
  chmod(file.c_str(), 0644);
  ChildResult r = launch({file});
  EXPECT_EQ(r.code, 126);
  EXPECT_EQ(r.err, "commgrad-run: cannot execute '" + file + "': Permission denied\n");
  r = launch({dir.path()});  // a directory
  EXPECT_EQ(r.code, 126);
  EXPECT_NE(r.err.find("cannot execute '" + dir.path() + "'"), std::string::npos) << r.err;
  // Found in PATH but not executable.
  r = launch({"not_executable"}, {{"PATH", dir.path()}});
  EXPECT_EQ(r.code, 126);
  EXPECT_EQ(r.err, "commgrad-run: cannot execute 'not_executable': Permission denied\n");
}

TEST(LauncherTest, ExecFailureInRankExits127) {
  TempDir dir;
  const std::string file = dir.path() + "/bad_interpreter";
  std::ofstream(file) << "#!/nonexistent/interpreter\n";
  chmod(file.c_str(), 0755);
  const ChildResult r = launch({"-n", "2", file});
  EXPECT_EQ(r.code, 127) << r.err;
  EXPECT_NE(r.err.find("cannot execute '" + file + "': No such file or directory"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(") exited with code 127"), std::string::npos) << r.err;
}

TEST(LauncherTest, RunsScriptWithoutShebangWithSh) {
  TempDir dir;
  const std::string file = dir.path() + "/script";
  std::ofstream(file) << "echo script-ran $RANK\n";
  chmod(file.c_str(), 0755);
  const ChildResult r = launch({"script"}, {{"PATH", dir.path() + ":/usr/bin:/bin"}});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "[0] script-ran 0\n");
}

TEST(LauncherTest, KillsWhatARankLeavesBehind) {
  // One child stays in the rank's process group, one escapes it with setsid.
  const std::string in_group = unique_marker();
  const std::string escaped = unique_marker();
  const ChildResult r = launch(
      {"-n", "2", "sh", "-c", "sleep " + in_group + " & setsid sleep " + escaped + " & sleep 0.2; echo started"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has_line(r.out, "[1] started")) << r.out;
  EXPECT_LT(r.seconds, kFastTeardownS);
  EXPECT_NO_LEFTOVERS(in_group);
  EXPECT_NO_LEFTOVERS(escaped);
}

TEST(LauncherTest, RanksDieWhenLauncherIsKilled) {
  // The sleeps are children of the ranks' shells: the watchdog must get them.
  const std::string marker = unique_marker();
  const std::string direct = unique_marker();
  ChildProcess child(launch_args(
      {"-n", "3", "sh", "-c", "if [ $RANK = 2 ]; then exec sleep " + direct + "; fi; echo ready; sleep " + marker}));
  ASSERT_TRUE(child.wait_for_stdout({"[0] ready", "[1] ready"}, kRunLimitS)) << child.err();
  ASSERT_TRUE(wait_for_processes("sleep " + marker, 2, kRunLimitS));
  ASSERT_TRUE(wait_for_processes("sleep " + direct, 1, kRunLimitS));
  child.send(SIGKILL);
  const ChildResult r = child.finish(kRunLimitS);
  EXPECT_EQ(r.code, 137);
  EXPECT_NO_LEFTOVERS(marker);
  EXPECT_NO_LEFTOVERS(direct);
}

// ~~~ restarts (--max-restarts), preemption, the job id ~~~

TEST(LauncherRestarts, AFailedJobIsStartedAgainWithTheRestartCount) {
  const ChildResult r =
      launch({"-n", "2", "--max-restarts", "2", "--stop-delay", "0", "sh", "-c",
              "echo start $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS; "
              "if [ $RANK = 0 ] && [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then sleep 0.2; exit 3; fi; "
              "if [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then sleep 10; fi"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  for (const std::string rank : {"0", "1"}) {
    for (const std::string count : {"0", "1", "2"}) {
      EXPECT_TRUE(has_line(r.out, "[" + rank + "] start " + count + " of 2")) << r.out;
    }
  }
  EXPECT_NE(r.err.find("commgrad-run: rank 0 (pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("commgrad-run: restarting the job (restart 1 of 2)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("commgrad-run: restarting the job (restart 2 of 2)"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, kFastTeardownS);
}

TEST(LauncherRestarts, WithNoRestartsLeftTheJobFailsNamingTheRankAndTheReason) {
  const std::string marker = unique_marker();
  const ChildResult r = launch({"-n", "2", "--max-restarts", "1", "sh", "-c",
                                "echo start $TORCHELASTIC_RESTART_COUNT; if [ $RANK = 1 ]; then kill -9 $$; fi; "
                                "sleep " +
                                    marker});
  EXPECT_EQ(r.code, 137) << r.err;
  EXPECT_TRUE(has_line(r.out, "[1] start 1")) << r.out;
  EXPECT_FALSE(has_line(r.out, "[1] start 2")) << r.out;
  const auto last = r.err.rfind("commgrad-run: rank 1 (pid ");
  ASSERT_NE(last, std::string::npos) << r.err;
  EXPECT_NE(r.err.find("was killed by signal SIGKILL (9)", last), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("commgrad-run: no restarts left (--max-restarts 1); the job failed", last), std::string::npos)
      << r.err;
  EXPECT_LT(r.seconds, kFastTeardownS);
  EXPECT_NO_LEFTOVERS(marker);
}

TEST(LauncherRestarts, APreemptedRankIsNotAFailureAndIsNotRestarted) {
  const ChildResult r =
      launch({"-n", "2", "--max-restarts", "3", "sh", "-c", "echo start $TORCHELASTIC_RESTART_COUNT; exit 75"});
  EXPECT_EQ(r.code, 75) << r.err;
  EXPECT_FALSE(has_line(r.out, "[0] start 1")) << r.out;
  EXPECT_NE(r.err.find("was preempted (exit code 75: it saved a checkpoint; not a failure)"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("restarting"), std::string::npos) << r.err;
}

TEST(LauncherRestarts, ASignalledLauncherWhoseRanksSavedExitsWithThePreemptedCode) {
  // The ranks catch SIGTERM, "save" and exit 75; the launcher is not restarted.
  const ChildResult r = launch({"-n", "2", "--max-restarts", "3", "sh", "-c",
                                "trap 'echo saving; exit 75' TERM; echo up; "
                                "if [ $RANK = 0 ]; then sleep 0.3; kill -TERM $PPID; fi; "
                                "i=0; while [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done"});
  EXPECT_EQ(r.code, 75) << r.out << r.err;
  EXPECT_TRUE(has_line(r.out, "[0] saving")) << r.out;
  EXPECT_TRUE(has_line(r.out, "[1] saving")) << r.out;
  EXPECT_EQ(r.err.find("restarting"), std::string::npos) << r.err;
}

TEST(LauncherRestarts, EveryRankOfAJobHasItsJobIdAndJobsDiffer) {
  const std::string print = "echo id=$TORCHELASTIC_RUN_ID";
  const ChildResult a = launch({"-n", "2", "sh", "-c", print});
  const ChildResult b = launch({"-n", "1", "sh", "-c", print});
  ASSERT_EQ(a.code, 0) << a.err;
  std::string id0;
  std::string id1;
  for (const std::string& line : lines_of(a.out)) {
    if (line.rfind("[0] id=", 0) == 0) id0 = line.substr(7);
    if (line.rfind("[1] id=", 0) == 0) id1 = line.substr(7);
  }
  EXPECT_EQ(id0.size(), 16u) << a.out;
  EXPECT_EQ(id0, id1);
  EXPECT_FALSE(has_line(b.out, "[0] id=" + id0)) << b.out;
  const ChildResult given = launch({"--rdzv-id", "job_7", "sh", "-c", print});
  EXPECT_TRUE(has_line(given.out, "[0] id=job_7")) << given.out;
  const ChildResult bad = launch({"--rdzv-id", "a b", "true"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("expected letters, digits and '_'"), std::string::npos) << bad.err;
}

TEST(LauncherRestarts, WhatAJobLeftInDevShmIsRemoved) {
  // As a rank 0 killed while a group was being set up leaves its segment.
  const ChildResult r = launch({"--rdzv-id", "leftover_" + std::to_string(getpid()), "sh", "-c",
                                "touch /dev/shm/commgrad-shm-${TORCHELASTIC_RUN_ID}-0123; "
                                "touch /dev/shm/commgrad-shm-${TORCHELASTIC_RUN_ID}x-0123; kill -9 $$"});
  EXPECT_EQ(r.code, 137) << r.err;
  const std::string id = "leftover_" + std::to_string(getpid());
  EXPECT_NE(access(("/dev/shm/commgrad-shm-" + id + "-0123").c_str(), F_OK), 0) << "left in /dev/shm";
  // Another job's segment stays.
  const std::string other = "/dev/shm/commgrad-shm-" + id + "x-0123";
  EXPECT_EQ(access(other.c_str(), F_OK), 0);
  unlink(other.c_str());
}

}  // namespace
}  // namespace commgrad::testing
