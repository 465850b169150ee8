// The founding example as real processes over the default transport ("auto":
// shm, since every rank is on this host): under commgrad-run
// at world sizes 1-4, alone, and under hand-set torchrun, mpirun and Slurm
// environments; plus the rendezvous and environment errors a user meets
// first. The example checks y, x.grad, x and the caller's gradient on every
// rank and exits non-zero on any mismatch, so exit code 0 means every rank
// agreed; rank 0's printout is checked here.

#include "commgrad/dist/build_info.h"
#include "harness/command_line.h"
#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>

namespace commgrad::testing {
namespace {

using ::testing::HasSubstr;

std::string example() { return build_path("bin/tp_autograd_comm"); }

std::string n_times(int n) {
  std::string v = std::to_string(n) + ".";
  return "tensor([" + v + ", " + v + ", " + v + ", " + v + "])";
}

void expect_founding_output(const ProcessResult& r, int n, const std::string& prefix) {
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr(prefix + "x.grad = " + n_times(n) + "\n"));
  EXPECT_THAT(r.out, HasSubstr(prefix + "y = " + n_times(n).substr(0, n_times(n).size() - 1) +
                               ", grad_fn=<AllReduceBackward>)\n"));
  EXPECT_THAT(r.out, HasSubstr(prefix + "x = tensor([1., 1., 1., 1.])\n"));
  EXPECT_THAT(r.out, HasSubstr(prefix + "after y.backward(g): g = tensor([1., 1., 1., 1.])\n"));
  // An optimised BLAS (OpenBLAS on Debian's LibTorch, MKL inside the wheel's).
  EXPECT_THAT(r.out, HasSubstr(prefix + "world: " + std::to_string(n) + " ranks, backend shm, BLAS: "));
  EXPECT_THAT(r.out, ::testing::AnyOf(HasSubstr("BLAS: OpenBLAS"), HasSubstr("BLAS: MKL")));
  EXPECT_THAT(r.out, HasSubstr(prefix + commgrad::build_info().to_string() + "\n"));
}

class FoundingExample : public ::testing::TestWithParam<int> {};

TEST_P(FoundingExample, UnderCommgradRun) {
  const int n = GetParam();
  auto r = run_process({launcher_path(), "-n", std::to_string(n), "--timeout", "60", example()}, clean_env());
  expect_founding_output(r, n, "[0] ");
  // Only rank 0 speaks on stdout.
  EXPECT_TRUE(lines_with_prefix(r.out, "[1] ").empty()) << r.out;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FoundingExample, ::testing::Values(1, 2, 3, 4));

TEST(FoundingExampleAlone, RunsAsAWorldOfOneWithANotice) {
  auto r = run_process({example()}, clean_env());
  expect_founding_output(r, 1, "");
  EXPECT_THAT(r.err, HasSubstr("no launcher variables"));
  EXPECT_THAT(r.err, HasSubstr("running as a single process (world size 1)"));
}

// Starts one process per rank with the variables `vars_of(rank, port)`, like
// a hand-written launch script would, and checks every rank's result.
void expect_hand_launch_works(int n, const std::function<std::map<std::string, std::string>(int)>& vars_of) {
  const auto port = std::to_string(free_port());
  std::vector<std::future<ProcessResult>> futures;
  for (int r = 0; r < n; ++r) {
    auto env = vars_of(r);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = port;
    futures.push_back(std::async(std::launch::async,
                                 [env] { return run_process({example()}, clean_env(env), std::chrono::seconds(60)); }));
  }
  std::vector<ProcessResult> results;
  for (auto& f : futures) results.push_back(f.get());
  expect_founding_output(results[0], n, "");
  for (auto& r : results) EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(FoundingExampleHandLaunched, TorchrunVariables) {
  expect_hand_launch_works(3, [](int r) {
    return std::map<std::string, std::string>{
        {"RANK", std::to_string(r)}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", std::to_string(r)}, {"LOCAL_WORLD_SIZE", "3"}};
  });
}

TEST(FoundingExampleHandLaunched, MpirunVariables) {
  expect_hand_launch_works(2, [](int r) {
    return std::map<std::string, std::string>{{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                                              {"OMPI_COMM_WORLD_SIZE", "2"},
                                              {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  });
}

TEST(FoundingExampleHandLaunched, SlurmVariables) {
  expect_hand_launch_works(2, [](int r) {
    return std::map<std::string, std::string>{{"SLURM_PROCID", std::to_string(r)},
                                              {"SLURM_NTASKS", "2"},
                                              {"SLURM_LOCALID", std::to_string(r)},
                                              {"SLURM_NTASKS_PER_NODE", "2"}};
  });
}

TEST(Rendezvous, TimeoutNamesTheMissingRanks) {
  // Rank 0 of 3 alone: it hosts the store, nobody else comes.
  auto r = run_process({example()}, clean_env({{"RANK", "0"},
                                               {"WORLD_SIZE", "3"},
                                               {"MASTER_ADDR", "127.0.0.1"},
                                               {"MASTER_PORT", std::to_string(free_port())},
                                               {"COMMGRAD_TIMEOUT", "1.5"}}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("rendezvous timed out after 1.5s: 1 of 3 ranks joined; missing ranks: [1, 2]"));
  EXPECT_LT(r.seconds, 20);
}

// Ranks 0 and 1 of 4 under one launcher (node 0 of 2; node 1 never comes):
// both print the verdict with the missing ranks, not only the store's host
// (rank 1 used to print c10d's "Failed to recv, got 0 bytes").
TEST(Rendezvous, EveryWaitingRankNamesTheMissingRanks) {
  auto r = run_process({launcher_path(), "--nnodes", "2", "--node-rank", "0", "-n", "2", "--master-addr", "127.0.0.1",
                        "--master-port", std::to_string(free_port()), "--stop-delay", "3", example()},
                       clean_env({{"COMMGRAD_TIMEOUT", "2"}}));
  EXPECT_NE(r.exit_code, 0);
  for (const std::string rank : {"0", "1"}) {
    const auto lines = lines_with_prefix(r.err, "[" + rank + "] ");
    std::string all;
    for (const auto& line : lines) all += line + "\n";
    EXPECT_THAT(all, HasSubstr("init_process_group rank " + rank +
                               "/4: rendezvous timed out after 2s: 2 of 4 ranks joined; missing ranks: [2, 3]"))
        << r.err;
    EXPECT_THAT(all, ::testing::Not(HasSubstr("Failed to recv"))) << r.err;
  }
  EXPECT_LT(r.seconds, 20);
}

// Two jobs on one port: rank 1 of job B reaches job A's store (A's rank 0 is
// waiting for its own rank 1) and is refused, naming both job ids; A's own
// rank 1 then joins and A runs to the end.
TEST(Rendezvous, ARankOfAnotherJobOnTheSamePortIsRefused) {
  const auto port = std::to_string(free_port());
  auto env = [&](int rank, const std::string& job) {
    return clean_env({{"RANK", std::to_string(rank)},
                      {"WORLD_SIZE", "2"},
                      {"MASTER_ADDR", "127.0.0.1"},
                      {"MASTER_PORT", port},
                      {"TORCHELASTIC_RUN_ID", job},
                      {"COMMGRAD_TIMEOUT", "30"}});
  };
  auto a0 = std::async(std::launch::async,
                       [&] { return run_process({example()}, env(0, "jobA"), std::chrono::seconds(60)); });
  auto b1 = run_process({example()}, env(1, "jobB"), std::chrono::seconds(60));
  EXPECT_EQ(b1.exit_code, 1) << b1.out << b1.err;
  EXPECT_THAT(b1.err, HasSubstr("init_process_group rank 1/2: the rendezvous store belongs to another job (its job id "
                                "'jobA', this rank's 'jobB') (store 127.0.0.1:" +
                                port + "): two jobs on one --master-port?"));
  auto a1 = run_process({example()}, env(1, "jobA"), std::chrono::seconds(60));
  EXPECT_EQ(a1.exit_code, 0) << a1.out << a1.err;
  const auto r0 = a0.get();
  expect_founding_output(r0, 2, "");
}

// Two launches on one --master-port at once: no rank ever joins the other
// job's world. Whichever job hosts the store runs; the other fails with a
// message that says why (it cannot host the store, or it is refused).
TEST(Rendezvous, TwoLaunchesOnOnePortNeverShareAWorld) {
  const auto port = std::to_string(free_port());
  auto launch = [&] {
    return run_process({launcher_path(), "-n", "2", "--master-port", port, "--timeout", "60", example()},
                       clean_env({{"COMMGRAD_TIMEOUT", "20"}}), std::chrono::seconds(90));
  };
  auto first = std::async(std::launch::async, launch);
  const auto second = launch();
  const auto other = first.get();
  int succeeded = 0;
  for (const auto* r : {&other, &second}) {
    if (r->exit_code == 0) {
      ++succeeded;
      expect_founding_output(*r, 2, "[0] ");
    } else {
      EXPECT_THAT(r->err, ::testing::AnyOf(HasSubstr("could not host the rendezvous store"),
                                           HasSubstr("the rendezvous store belongs to another job"),
                                           HasSubstr("another process already joined as rank")))
          << r->err;
    }
  }
  EXPECT_GE(succeeded, 1) << other.err << "\n---\n" << second.err;
}

TEST(Rendezvous, UnreachableStoreIsAClearError) {
  auto r = run_process({example()}, clean_env({{"RANK", "1"},
                                               {"WORLD_SIZE", "2"},
                                               {"MASTER_ADDR", "127.0.0.1"},
                                               {"MASTER_PORT", std::to_string(free_port())},
                                               {"COMMGRAD_TIMEOUT", "1.5"}}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err,
              HasSubstr("[commgrad] init_process_group rank 1/2: could not reach the rendezvous store at 127.0.0.1:"));
  EXPECT_LT(r.seconds, 20);
}

TEST(Rendezvous, HalfSetEnvironmentFailsBeforeAnyNetworking) {
  auto r = run_process({example()}, clean_env({{"RANK", "0"}}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("RANK is set but WORLD_SIZE is not"));
  EXPECT_THAT(r.err, HasSubstr("commgrad-run -n N"));
}

TEST(Rendezvous, DeadRankEndsTheJobThroughTheLauncher) {
  // Rank 1 of a 2-rank job is not a commgrad program at all and exits 3:
  // the launcher stops rank 0 (waiting in the rendezvous) and reports rank 1.
  auto r = run_process(
      {launcher_path(), "-n", "2", "--", "/bin/sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec " + example()},
      clean_env({{"COMMGRAD_TIMEOUT", "30"}}));
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_THAT(r.err, HasSubstr("rank 1"));
  EXPECT_LT(r.seconds, 15);
}

// Every option in --help; each bad one named, exit code 2, before any rank starts.
TEST(FoundingExample, BadOptionsAreNamedBeforeAnyRankStarts) {
  expect_help_lists(example(), {"--device"});
  expect_bad_options(example(), {
                                    {{"--bogus"}, "unknown option '--bogus'"},
                                    {{"extra"}, "unexpected argument 'extra'"},
                                    {{"--device", "gpu"}, "--device: expected one of cpu, cuda, got 'gpu'"},
                                    {{"--device"}, "--device: 1 required"},
                                });
}

}  // namespace
}  // namespace commgrad::testing
