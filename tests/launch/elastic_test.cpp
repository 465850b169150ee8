// commgrad-run --nnodes MIN:MAX with two node agents on this host (two
// commgrad-run processes meeting at one --master-port; the multi-host form
// is in tests/multihost): node ranks and WORLD_SIZE handed out per round, a
// node that does not come back left out after the last call, fewer than MIN
// nodes a clear failure, a stranger refused, and the command line's errors.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "launch/child_process.h"

namespace commgrad::testing {
namespace {

constexpr double kRunLimitS = 40;

std::string launcher_path() {
  if (const char* path = std::getenv("COMMGRAD_RUN")) return path;
  return COMMGRAD_RUN_PATH;
}

// A port nobody listens on now (the kernel's pick for port 0).
std::string free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return std::to_string(ntohs(addr.sin_port));
}

// commgrad-run --nnodes `nodes` at 127.0.0.1:`port`, 2 ranks, then `extra`
// options and `sh -c script`.
std::vector<std::string> agent(const std::string& nodes, const std::string& port, const std::string& script,
                               std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {launcher_path(),
                                   "--nnodes",
                                   nodes,
                                   "--master-addr",
                                   "127.0.0.1",
                                   "--master-port",
                                   port,
                                   "-n",
                                   "2",
                                   "--rdzv-last-call",
                                   "2",
                                   "--grace",
                                   "2"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"sh", "-c", script});
  return argv;
}

std::string describe(const ChildResult& a, const ChildResult& b) {
  std::ostringstream s;
  s << "--- agent a: exit " << a.code << "\n"
    << a.out << a.err << "--- agent b: exit " << b.code << "\n"
    << b.out << b.err;
  return s.str();
}

bool has_line(const std::string& text, const std::string& line) {
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);)
    if (l == line) return true;
  return false;
}

// commgrad-run does not link LibTorch: the second LibTorch line would only
// repeat these cases (about 10 s).
class ElasticLaunch : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef COMMGRAD_ON_SECOND_TORCH_LINE
    GTEST_SKIP() << "commgrad-run does not depend on LibTorch: these cases run on the default line only";
#endif
  }
};

TEST_F(ElasticLaunch, TwoAgentsGetNodeRanksAndTheWorldOfTheRound) {
  const std::string port = free_port();
  const std::string script =
      "echo R=$RANK W=$WORLD_SIZE G=$GROUP_RANK GW=$GROUP_WORLD_SIZE L=$LOCAL_RANK P=$MASTER_PORT";
  ChildProcess a(agent("1:2", port, script));
  ChildProcess b(agent("1:2", port, script));
  const ChildResult ra = a.finish(kRunLimitS);
  const ChildResult rb = b.finish(kRunLimitS);
  ASSERT_EQ(ra.code, 0) << describe(ra, rb);
  ASSERT_EQ(rb.code, 0) << describe(ra, rb);
  // One agent is node 0 (it hosts the rendezvous), the other node 1; the
  // ranks' MASTER_PORT is the round's, not the rendezvous's, and the same everywhere.
  const std::string all = ra.out + rb.out;
  std::set<std::string> ports;
  std::istringstream lines(all);
  int found = 0;
  for (std::string line; std::getline(lines, line);) {
    int rank = -1, world = -1, group = -1, groups = -1, local = -1, rank_port = -1;
    if (std::sscanf(line.c_str(), "[%*d] R=%d W=%d G=%d GW=%d L=%d P=%d", &rank, &world, &group, &groups, &local,
                    &rank_port) != 6) {
      continue;
    }
    EXPECT_EQ(world, 4) << line;
    EXPECT_EQ(group, rank / 2) << line;
    EXPECT_EQ(groups, 2) << line;
    EXPECT_EQ(local, rank % 2) << line;
    ports.insert(std::to_string(rank_port));
    found |= 1 << rank;
  }
  EXPECT_EQ(found, 0xf) << describe(ra, rb);
  EXPECT_EQ(ports.size(), 1u) << describe(ra, rb);
  EXPECT_EQ(ports.count(port), 0u) << describe(ra, rb);
  EXPECT_NE((ra.err + rb.err).find("commgrad-run: rendezvous round 1: node 0 of 2 (--nnodes 1:2), WORLD_SIZE 4"),
            std::string::npos)
      << describe(ra, rb);
  EXPECT_NE((ra.err + rb.err).find("commgrad-run: rendezvous round 1: node 1 of 2 (--nnodes 1:2), WORLD_SIZE 4"),
            std::string::npos)
      << describe(ra, rb);
}

// Node 1's first start kills its own launcher (the node is gone for good);
// node 0's ranks fail, it restarts, waits out the last call alone and runs
// the job at half the world.
TEST_F(ElasticLaunch, ANodeThatDoesNotComeBackIsLeftOutAfterTheLastCall) {
  const std::string port = free_port();
  const std::string script =
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then"
      "  if [ \"$GROUP_RANK\" = 1 ]; then [ \"$LOCAL_RANK\" = 0 ] && kill -KILL $PPID; sleep 20; fi;"
      "  sleep 1; exit 3; "
      "fi; echo W=$WORLD_SIZE G=$GROUP_RANK";
  ChildProcess a(agent("1:2", port, script, {"--max-restarts", "1"}));
  ChildProcess b(agent("1:2", port, script, {"--max-restarts", "1"}));
  const ChildResult ra = a.finish(kRunLimitS);
  const ChildResult rb = b.finish(kRunLimitS);
  const ChildResult& survivor = ra.code == 128 + SIGKILL ? rb : ra;
  const ChildResult& lost = ra.code == 128 + SIGKILL ? ra : rb;
  EXPECT_EQ(lost.code, 128 + SIGKILL) << describe(ra, rb);
  ASSERT_EQ(survivor.code, 0) << describe(ra, rb);
  EXPECT_NE(survivor.err.find("rendezvous round 1: node 0 of 2 (--nnodes 1:2), WORLD_SIZE 4"), std::string::npos)
      << describe(ra, rb);
  EXPECT_NE(survivor.err.find("exited with code 3"), std::string::npos) << describe(ra, rb);
  EXPECT_NE(survivor.err.find("restarting the job (restart 1 of 1)"), std::string::npos) << describe(ra, rb);
  EXPECT_NE(survivor.err.find("rendezvous round 2: node 0 of 1 (--nnodes 1:2), WORLD_SIZE 2"), std::string::npos)
      << describe(ra, rb);
  EXPECT_TRUE(has_line(survivor.out, "[0] W=2 G=0")) << describe(ra, rb);
  EXPECT_TRUE(has_line(survivor.out, "[1] W=2 G=0")) << describe(ra, rb);
}

// Node 1's ranks fail at once on the first start while node 0's would run
// for 30 s: node 1 comes back to the rendezvous, node 0 hears of it, stops
// its ranks and joins the new round (not counted as a restart), and the
// second start runs on both nodes. And the other way round: node 0's ranks
// fail while node 1's would run; node 0 opens a new round and tells node 1.
TEST_F(ElasticLaunch, AFailureOnOneNodeStartsANewRoundOnTheOthers) {
  for (const std::string failing : {"1", "0"}) {
    char dir_template[] = "/tmp/commgrad_elastic_XXXXXX";
    const std::string dir = mkdtemp(dir_template);
    const std::string port = free_port();
    // The first start is the one whose MASTER_PORT the first rank recorded
    // (ln: the first writer wins; the failing rank writes before it fails).
    const std::string script = "echo $MASTER_PORT > " + dir + "/t$$; ln " + dir + "/t$$ " + dir +
                               "/first 2>/dev/null; if [ \"$(cat " + dir +
                               "/first)\" = \"$MASTER_PORT\" ]; then"
                               "  if [ \"$GROUP_RANK\" = " +
                               failing +
                               " ]; then exit 3; fi; exec sleep 30; "
                               "fi; echo W=$WORLD_SIZE G=$GROUP_RANK";
    ChildProcess a(agent("1:2", port, script, {"--max-restarts", "1"}));
    ChildProcess b(agent("1:2", port, script, {"--max-restarts", "1"}));
    const ChildResult ra = a.finish(kRunLimitS);
    const ChildResult rb = b.finish(kRunLimitS);
    std::system(("rm -rf '" + dir + "'").c_str());
    ASSERT_EQ(ra.code, 0) << "failing node " << failing << "\n" << describe(ra, rb);
    ASSERT_EQ(rb.code, 0) << "failing node " << failing << "\n" << describe(ra, rb);
    const std::string err = ra.err + rb.err;
    const std::string out = ra.out + rb.out;
    EXPECT_NE(err.find("restarting the job (restart 1 of 1)"), std::string::npos) << describe(ra, rb);
    EXPECT_NE(err.find(failing == "1" ? "a node came to the rendezvous; stopping 2 ranks to join it"
                                      : "the rendezvous opened a new round; stopping 2 ranks to join it"),
              std::string::npos)
        << describe(ra, rb);
    EXPECT_NE(err.find("starting this node's ranks again in the new rendezvous round (not counted as a restart)"),
              std::string::npos)
        << describe(ra, rb);
    for (const std::string rank : {"0", "1", "2", "3"}) {
      const std::string line = "[" + rank + "] W=4 G=" + (rank == "0" || rank == "1" ? "0" : "1");
      EXPECT_TRUE(has_line(out, line)) << line << "\n" << describe(ra, rb);
    }
    EXPECT_LT(ra.seconds, 20) << describe(ra, rb);
  }
}

// A node beyond MAX is refused; its knock still makes the running node
// start its ranks again (the rendezvous cannot tell why a node knocks).
TEST_F(ElasticLaunch, ANodeBeyondMaxIsRefused) {
  const std::string port = free_port();
  ChildProcess a(agent("1:1", port, "sleep 1; echo W=$WORLD_SIZE"));
  usleep(300 * 1000);
  ChildProcess b(agent("1:1", port, "echo W=$WORLD_SIZE"));
  const ChildResult rb = b.finish(kRunLimitS);
  const ChildResult ra = a.finish(kRunLimitS);
  EXPECT_EQ(ra.code, 0) << describe(ra, rb);
  EXPECT_TRUE(has_line(ra.out, "[0] W=2")) << describe(ra, rb);
  EXPECT_EQ(rb.code, 1) << describe(ra, rb);
  EXPECT_EQ(rb.out, "") << describe(ra, rb);
  EXPECT_NE(rb.err.find("commgrad-run: the job is full: it has the most nodes --nnodes allows (1)"), std::string::npos)
      << describe(ra, rb);
}

TEST_F(ElasticLaunch, FewerThanMinNodesIsAClearFailure) {
  const std::string port = free_port();
  ChildProcess a(agent("2:3", port, "echo ran", {"--rdzv-join-timeout", "1"}));
  const ChildResult r = a.finish(kRunLimitS);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_EQ(r.out, "");  // no rank started
  EXPECT_NE(r.err.find("commgrad-run: rendezvous round 1 at 127.0.0.1:" + port +
                       " failed: 1 of at least 2 nodes joined within --rdzv-join-timeout 1s"),
            std::string::npos)
      << r.err;
  EXPECT_LT(r.seconds, 10);
}

// --timeout counts the rendezvous too: a host waiting for nodes, and a
// guest waiting for a host that never comes.
TEST_F(ElasticLaunch, TimeoutEndsAWaitInTheRendezvous) {
  for (const std::string nodes : {"2:2", "1:2"}) {
    const std::string port = free_port();
    ChildProcess host(agent(nodes, port, "echo ran", {"--timeout", "1"}));
    const ChildResult r = host.finish(kRunLimitS);
    EXPECT_EQ(r.code, 124) << r.out << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_NE(r.err.find("commgrad-run: job exceeded --timeout 1s in the rendezvous"), std::string::npos) << r.err;
    EXPECT_LT(r.seconds, 10);
  }
  // A guest: the address is this host's, but another process holds the
  // port without answering.
  const int holder = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(holder, 8), 0);
  socklen_t len = sizeof(addr);
  getsockname(holder, reinterpret_cast<sockaddr*>(&addr), &len);
  ChildProcess guest(agent("1:2", std::to_string(ntohs(addr.sin_port)), "echo ran", {"--timeout", "1"}));
  const ChildResult r = guest.finish(kRunLimitS);
  close(holder);
  EXPECT_EQ(r.code, 124) << r.out << r.err;
  EXPECT_NE(r.err.find("commgrad-run: job exceeded --timeout 1s in the rendezvous"), std::string::npos) << r.err;
}

TEST_F(ElasticLaunch, AnAgentOfAnotherJobIsRefused) {
  const std::string port = free_port();
  ChildProcess a(agent("1:2", port, "echo W=$WORLD_SIZE", {"--rdzv-id", "job_a"}));
  ChildProcess b(agent("1:2", port, "echo W=$WORLD_SIZE", {"--rdzv-id", "job_b"}));
  const ChildResult ra = a.finish(kRunLimitS);
  const ChildResult rb = b.finish(kRunLimitS);
  // Whichever hosts runs alone; the other is told why it may not join.
  const ChildResult& refused = ra.code != 0 ? ra : rb;
  const ChildResult& host = ra.code != 0 ? rb : ra;
  EXPECT_EQ(host.code, 0) << describe(ra, rb);
  EXPECT_EQ(refused.code, 1) << describe(ra, rb);
  EXPECT_TRUE(has_line(host.out, "[0] W=2")) << describe(ra, rb);
  EXPECT_NE(refused.err.find("commgrad-run: the rendezvous belongs to another job (--rdzv-id 'job_"), std::string::npos)
      << describe(ra, rb);
}

TEST_F(ElasticLaunch, HelpNamesTheElasticOptions) {
  ChildProcess child({launcher_path(), "--help"});
  const ChildResult r = child.finish(kRunLimitS);
  EXPECT_EQ(r.code, 0);
  for (const char* text : {"--nnodes M|MIN:MAX", "--rdzv-last-call", "--rdzv-join-timeout", "With --nnodes MIN:MAX"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.out;
  }
}

// Errors of the elastic command line, each named, exit code 2.
TEST_F(ElasticLaunch, BadNodeRangesAreNamed) {
  const std::string limit = "1 <= MIN <= MAX <= 1048576";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--nnodes", "2:1", "true"},
       "--nnodes: expected MIN:MAX with integers " + limit + ", got '2:1' (MIN 2 > MAX 1)"},
      {{"--nnodes", "0:2", "true"}, "--nnodes: expected MIN:MAX with integers " + limit + ", got '0:2' (MIN 0 < 1)"},
      {{"--nnodes", "1:x", "true"}, "--nnodes: expected MIN:MAX with integers " + limit + ", got '1:x'"},
      {{"--nnodes", ":2", "true"}, "--nnodes: expected MIN:MAX with integers " + limit + ", got ':2'"},
      {{"--nnodes", "1:2:3", "true"}, "--nnodes: expected MIN:MAX with integers " + limit + ", got '1:2:3'"},
      {{"--nnodes", "1:2", "true"}, "--nnodes 1:2 needs --master-addr and --master-port"},
      {{"--nnodes", "1:2", "--master-addr", "127.0.0.1", "--master-port", "29500", "--node-rank", "0", "true"},
       "--nnodes 1:2 hands out node ranks at the rendezvous; --node-rank is not allowed with it"},
      {{"--rdzv-last-call", "-1", "true"}, "--rdzv-last-call: expected a number >= 0"},
      {{"--rdzv-join-timeout", "0", "true"}, "--rdzv-join-timeout: expected a number > 0"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv = {launcher_path()};
    argv.insert(argv.end(), args.begin(), args.end());
    ChildProcess child(argv);
    const ChildResult r = child.finish(kRunLimitS);
    EXPECT_EQ(r.code, 2) << args[1];
    EXPECT_NE(r.err.find("commgrad-run: " + message), std::string::npos) << args[1] << ": " << r.err;
  }
}

}  // namespace
}  // namespace commgrad::testing
