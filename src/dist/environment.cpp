// Parsing of the launch environment (torchrun, mpirun, Slurm conventions).
//
// Precedence: torchrun's variables, then Open MPI's, then Slurm's (commgrad-run
// and torchrun set RANK even when started inside an allocation). Every error
// names the variable and says how to launch properly, because a half-set
// environment is almost always a hand-written launch script gone wrong.

#include "commgrad/dist/environment.h"

#include "commgrad/util/env.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace commgrad {
namespace {

// Under commgrad-run stdout is a pipe, which stdio buffers fully: a rank
// that the launcher stops (because another failed) would lose what it
// printed but had not flushed. Line buffering, set as the library loads
// (before main prints anything), sends each line as it is written.
[[maybe_unused]] const bool g_line_buffered = [] {
  if (env::get("COMMGRAD_LINE_BUFFERED").value_or("") != "1") return false;
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  return true;
}();

constexpr const char* kHowToLaunch =
    "launch with `commgrad-run -n N program`, `torchrun --no-python --nproc-per-node N program`, "
    "`mpirun -n N program` or `srun -n N program`, or unset the launcher variables to run as a "
    "single process";

// Parses a non-negative integer; `what` names the variable in the error.
int parse_int(const std::string& name, const std::string& value) {
  TORCH_CHECK(!value.empty(), "[commgrad] init_process_group: ", name, " is set but empty; ", kHowToLaunch);
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  TORCH_CHECK(end != nullptr && *end == '\0' && errno == 0 && v >= 0 && v <= (1 << 24),
              "[commgrad] init_process_group: ", name, "='", value, "' is not a non-negative integer; ", kHowToLaunch);
  return static_cast<int>(v);
}

struct Names {
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

// Reads rank/size (both or neither) and local rank/size of one convention.
bool read_ranks(const LaunchEnvironment::Lookup& get, const Names& n, LaunchEnvironment& env) {
  const auto rank = get(n.rank);
  const auto size = get(n.size);
  if (!rank && !size) return false;
  TORCH_CHECK(rank.has_value(), "[commgrad] init_process_group: ", n.size, " is set but ", n.rank, " is not; ",
              kHowToLaunch);
  TORCH_CHECK(size.has_value(), "[commgrad] init_process_group: ", n.rank, " is set but ", n.size, " is not; ",
              kHowToLaunch);
  env.rank = parse_int(n.rank, *rank);
  env.world_size = parse_int(n.size, *size);
  TORCH_CHECK(env.world_size >= 1, "[commgrad] init_process_group: ", n.size, "=0; the world needs at least one rank");
  TORCH_CHECK(env.rank < env.world_size, "[commgrad] init_process_group: ", n.rank, "=", env.rank,
              " is out of range for ", n.size, "=", env.world_size, " (expected 0..", env.world_size - 1, ")");

  const auto local_rank = get(n.local_rank);
  const auto local_size = n.local_size ? get(n.local_size) : std::nullopt;
  if (local_size && !local_rank) {
    TORCH_CHECK(false, "[commgrad] init_process_group: ", n.local_size, " is set but ", n.local_rank, " is not; ",
                kHowToLaunch);
  }
  // Without local variables, assume a single host (a hand-set environment).
  env.local_world_size = local_size ? parse_int(n.local_size, *local_size) : env.world_size;
  env.local_rank = local_rank ? parse_int(n.local_rank, *local_rank) : env.rank;
  if (local_rank && !local_size) {
    // e.g. Slurm with an irregular task layout: the local size is unknown;
    // the local rank alone is still useful (device selection).
    env.local_world_size = std::max(env.local_rank + 1, env.local_world_size);
  }
  TORCH_CHECK(env.local_world_size >= 1 && env.local_world_size <= env.world_size,
              "[commgrad] init_process_group: ", n.local_size ? n.local_size : "local world size", "=",
              env.local_world_size, " must be between 1 and ", n.size, "=", env.world_size);
  TORCH_CHECK(env.local_rank < env.local_world_size, "[commgrad] init_process_group: ", n.local_rank, "=",
              env.local_rank, " is out of range for a local world of ", env.local_world_size, " (expected 0..",
              env.local_world_size - 1, ")");
  return true;
}

}  // namespace

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone:
      return "none";
    case Launcher::kTorchrun:
      return "torchrun";
    case Launcher::kMpirun:
      return "mpirun";
    case Launcher::kSlurm:
      return "slurm";
  }
  return "?";
}

LaunchEnvironment LaunchEnvironment::parse(const Lookup& get) {
  LaunchEnvironment env;
  if (read_ranks(get, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}, env)) {
    env.launcher = Launcher::kTorchrun;
  } else if (read_ranks(get,
                        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                         "OMPI_COMM_WORLD_LOCAL_SIZE"},
                        env)) {
    env.launcher = Launcher::kMpirun;
  } else if (read_ranks(get, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr}, env)) {
    env.launcher = Launcher::kSlurm;
    // SLURM_NTASKS_PER_NODE is a plain number only for regular layouts.
    if (auto per_node = get("SLURM_NTASKS_PER_NODE")) {
      if (!per_node->empty() && per_node->find_first_not_of("0123456789") == std::string::npos) {
        env.local_world_size = parse_int("SLURM_NTASKS_PER_NODE", *per_node);
        TORCH_CHECK(env.local_rank < env.local_world_size && env.local_world_size <= env.world_size,
                    "[commgrad] init_process_group: SLURM_LOCALID=", env.local_rank,
                    " / SLURM_NTASKS_PER_NODE=", env.local_world_size, " / SLURM_NTASKS=", env.world_size,
                    " are inconsistent");
      }
    }
  } else {
    for (const char* stray : {"LOCAL_RANK", "LOCAL_WORLD_SIZE"}) {
      TORCH_CHECK(!get(stray).has_value(), "[commgrad] init_process_group: ", stray,
                  " is set but RANK and WORLD_SIZE are not; ", kHowToLaunch);
    }
    return env;  // a world of one
  }

  const auto addr = get("MASTER_ADDR");
  const auto port = get("MASTER_PORT");
  if (env.world_size > 1) {
    TORCH_CHECK(addr.has_value() && !addr->empty(), "[commgrad] init_process_group: ", launcher_name(env.launcher),
                " variables are set (world size ", env.world_size,
                ") but MASTER_ADDR is not; set MASTER_ADDR and MASTER_PORT to the address of rank 0's "
                "rendezvous store (commgrad-run and torchrun set them for you)");
    TORCH_CHECK(port.has_value(), "[commgrad] init_process_group: ", launcher_name(env.launcher),
                " variables are set (world size ", env.world_size,
                ") but MASTER_PORT is not; set MASTER_ADDR and MASTER_PORT to the address of "
                "rank 0's rendezvous store (commgrad-run and torchrun set them for you)");
  }
  if (addr && !addr->empty()) env.master_addr = *addr;
  if (port) {
    const int p = parse_int("MASTER_PORT", *port);
    TORCH_CHECK(p >= 1 && p <= 65535, "[commgrad] init_process_group: MASTER_PORT=", *port,
                " is out of range (expected 1..65535)");
    env.master_port = p;
  }
  return env;
}

LaunchEnvironment LaunchEnvironment::from_env() {
  return parse([](const std::string& name) { return env::get(name); });
}

std::string LaunchEnvironment::describe() const {
  return c10::str("rank ", rank, "/", world_size, " (local ", local_rank, "/", local_world_size, ") via ",
                  launcher_name(launcher), ", store ", master_addr, ":", master_port);
}

}  // namespace commgrad
