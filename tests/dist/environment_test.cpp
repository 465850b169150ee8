// Launch-environment parsing: torchrun, mpirun and Slurm conventions, no
// launcher at all, and every half-set or invalid case with its own message.

#include "commgrad/dist/environment.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

namespace commgrad {
namespace {

LaunchEnvironment parse(const std::map<std::string, std::string>& vars) {
  return LaunchEnvironment::parse([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    parse(vars);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

TEST(Environment, NoVariablesMeansWorldOfOne) {
  auto env = parse({});
  EXPECT_EQ(env.launcher, Launcher::kNone);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_TRUE(env.single_host());
}

TEST(Environment, Torchrun) {
  auto env = parse({{"RANK", "5"},
                    {"WORLD_SIZE", "8"},
                    {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "4"},
                    {"MASTER_ADDR", "10.1.2.3"},
                    {"MASTER_PORT", "1234"}});
  EXPECT_EQ(env.launcher, Launcher::kTorchrun);
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "10.1.2.3");
  EXPECT_EQ(env.master_port, 1234);
  EXPECT_FALSE(env.single_host());
  EXPECT_EQ(env.describe(), "rank 5/8 (local 1/4) via torchrun, store 10.1.2.3:1234");
}

TEST(Environment, TorchrunWithoutLocalVariablesAssumesOneHost) {
  auto env = parse({{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 3);
  EXPECT_TRUE(env.single_host());
}

TEST(Environment, Mpirun) {
  auto env = parse({{"OMPI_COMM_WORLD_RANK", "3"},
                    {"OMPI_COMM_WORLD_SIZE", "4"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                    {"MASTER_ADDR", "127.0.0.1"},
                    {"MASTER_PORT", "29501"}});
  EXPECT_EQ(env.launcher, Launcher::kMpirun);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
}

TEST(Environment, Slurm) {
  auto env = parse({{"SLURM_PROCID", "6"},
                    {"SLURM_NTASKS", "8"},
                    {"SLURM_LOCALID", "2"},
                    {"SLURM_NTASKS_PER_NODE", "4"},
                    {"MASTER_ADDR", "node1"},
                    {"MASTER_PORT", "29500"}});
  EXPECT_EQ(env.launcher, Launcher::kSlurm);
  EXPECT_EQ(env.rank, 6);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 4);
}

TEST(Environment, SlurmIrregularLayoutKeepsLocalRank) {
  auto env = parse({{"SLURM_PROCID", "1"},
                    {"SLURM_NTASKS", "3"},
                    {"SLURM_LOCALID", "1"},
                    {"SLURM_NTASKS_PER_NODE", "2(x1),1"},
                    {"MASTER_ADDR", "n"},
                    {"MASTER_PORT", "1"}});
  EXPECT_EQ(env.local_rank, 1);
}

TEST(Environment, TorchrunTakesPrecedenceOverSlurm) {
  // commgrad-run or torchrun started inside a Slurm allocation.
  auto env = parse({{"RANK", "1"},
                    {"WORLD_SIZE", "2"},
                    {"SLURM_PROCID", "0"},
                    {"SLURM_NTASKS", "1"},
                    {"MASTER_ADDR", "127.0.0.1"},
                    {"MASTER_PORT", "29500"}});
  EXPECT_EQ(env.launcher, Launcher::kTorchrun);
  EXPECT_EQ(env.rank, 1);
}

TEST(Environment, WorldOfOneNeedsNoStoreAddress) {
  auto env = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(env.world_size, 1);
}

TEST(Environment, HalfSetAndInvalidCasesEachSayWhat) {
  EXPECT_THAT(error_of({{"RANK", "0"}}), ::testing::HasSubstr("RANK is set but WORLD_SIZE is not"));
  EXPECT_THAT(error_of({{"WORLD_SIZE", "2"}}), ::testing::HasSubstr("WORLD_SIZE is set but RANK is not"));
  EXPECT_THAT(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}),
              ::testing::HasSubstr("RANK='abc' is not a non-negative integer"));
  EXPECT_THAT(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}),
              ::testing::HasSubstr("RANK='-1' is not a non-negative integer"));
  EXPECT_THAT(error_of({{"RANK", ""}, {"WORLD_SIZE", "2"}}), ::testing::HasSubstr("RANK is set but empty"));
  EXPECT_THAT(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}),
              ::testing::HasSubstr("RANK=4 is out of range for WORLD_SIZE=4 (expected 0..3)"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), ::testing::HasSubstr("WORLD_SIZE=0"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}}),
              ::testing::HasSubstr("MASTER_ADDR is not"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}),
              ::testing::HasSubstr("MASTER_PORT is not"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}),
              ::testing::HasSubstr("MASTER_PORT=70000 is out of range (expected 1..65535)"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "0"}}),
              ::testing::HasSubstr("MASTER_PORT=0 is out of range"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "x1"}}),
              ::testing::HasSubstr("MASTER_PORT='x1' is not a non-negative integer"));
  EXPECT_THAT(error_of({{"LOCAL_RANK", "0"}}), ::testing::HasSubstr("LOCAL_RANK is set but RANK and WORLD_SIZE"));
  EXPECT_THAT(
      error_of(
          {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
      ::testing::HasSubstr("LOCAL_WORLD_SIZE is set but LOCAL_RANK is not"));
  EXPECT_THAT(error_of({{"RANK", "0"},
                        {"WORLD_SIZE", "4"},
                        {"LOCAL_RANK", "2"},
                        {"LOCAL_WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "1"}}),
              ::testing::HasSubstr("LOCAL_RANK=2 is out of range for a local world of 2"));
  EXPECT_THAT(error_of({{"RANK", "0"},
                        {"WORLD_SIZE", "2"},
                        {"LOCAL_RANK", "0"},
                        {"LOCAL_WORLD_SIZE", "3"},
                        {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "1"}}),
              ::testing::HasSubstr("LOCAL_WORLD_SIZE=3 must be between 1 and WORLD_SIZE=2"));
  EXPECT_THAT(error_of({{"OMPI_COMM_WORLD_RANK", "0"}}),
              ::testing::HasSubstr("OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not"));
  EXPECT_THAT(error_of({{"SLURM_NTASKS", "2"}}), ::testing::HasSubstr("SLURM_NTASKS is set but SLURM_PROCID is not"));
  // Every message says how to launch properly.
  EXPECT_THAT(error_of({{"RANK", "0"}}), ::testing::HasSubstr("commgrad-run -n N"));
}

}  // namespace
}  // namespace commgrad
