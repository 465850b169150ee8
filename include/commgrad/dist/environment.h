#pragma once
// Who this process is in the job, read from the launcher's environment.
//
// commgrad reads the same variables as torchrun, so a program can be started
// by commgrad-run, torchrun --no-python, mpirun or srun:
//
//   torchrun / commgrad-run  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
//   mpirun (Open MPI)        OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   srun (Slurm)             SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
//
// and, for every launcher, MASTER_ADDR / MASTER_PORT for the rendezvous store.
// No launcher variables at all means a world of one.

#include <functional>
#include <optional>
#include <string>

namespace commgrad {

/// Which convention the environment followed.
enum class Launcher { kNone, kTorchrun, kMpirun, kSlurm };

/// "none", "torchrun", "mpirun", "slurm".
const char* launcher_name(Launcher launcher);

/// The parsed launch environment of one process.
struct LaunchEnvironment {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;

  /// Reads this process's environment. A half-set or invalid environment
  /// throws a c10::Error naming the variable and how to launch properly.
  ///
  /// Example:
  ///   auto env = commgrad::LaunchEnvironment::from_env();
  ///   if (env.launcher == commgrad::Launcher::kNone) { /* single process */ }
  static LaunchEnvironment from_env();

  /// Same rules, with variables looked up through `lookup` (for tests).
  using Lookup = std::function<std::optional<std::string>(const std::string&)>;
  static LaunchEnvironment parse(const Lookup& lookup);

  /// True when every rank of the job runs on this host.
  bool single_host() const { return local_world_size == world_size; }

  /// "rank 1/4 (local 1/4) via torchrun, store 127.0.0.1:29500"
  std::string describe() const;
};

}  // namespace commgrad
