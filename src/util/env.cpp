// The list of environment variables commgrad reads, and the one reader.

#include "commgrad/util/env.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace commgrad::env {

const std::vector<Variable>& variables() {
  static const std::vector<Variable> list = {
      // Launch: torchrun's conventions (commgrad-run sets the same), then Open MPI's, then Slurm's.
      {"RANK", "0..WORLD_SIZE-1", "this process's rank in the world (torchrun, commgrad-run)"},
      {"WORLD_SIZE", "integer >= 1", "number of ranks in the world"},
      {"LOCAL_RANK", "0..LOCAL_WORLD_SIZE-1", "rank among the ranks of this host; picks cuda:LOCAL_RANK"},
      {"LOCAL_WORLD_SIZE", "integer >= 1", "number of ranks on this host"},
      {"MASTER_ADDR", "host name or address", "where rank 0 serves the rendezvous store"},
      {"MASTER_PORT", "1..65535", "the rendezvous store's port"},
      {"OMPI_COMM_WORLD_RANK", "integer", "rank under mpirun (read when RANK is unset)"},
      {"OMPI_COMM_WORLD_SIZE", "integer", "world size under mpirun"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "integer", "local rank under mpirun"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "integer", "ranks on this host under mpirun"},
      {"SLURM_PROCID", "integer", "rank under srun (read when RANK and OMPI_* are unset)"},
      {"SLURM_NTASKS", "integer", "world size under srun"},
      {"SLURM_LOCALID", "integer", "local rank under srun"},
      {"SLURM_NTASKS_PER_NODE", "integer (regular layouts)", "ranks on this host under srun"},
      {"TORCHELASTIC_RUN_ID", "a word",
       "the job's id (commgrad-run, torchrun's --rdzv-id): ranks of another job "
       "that meet at the same rendezvous port are refused; names the job's shm segments"},
      {"TORCHELASTIC_RESTART_COUNT", "integer >= 0",
       "how often the launcher restarted the job (commgrad-run "
       "--max-restarts, torchrun); read by programs, e.g. to resume from a checkpoint"},
      // Behaviour.
      {"COMMGRAD_BACKEND", "auto, gloo, shm, hierarchical, nccl",
       "transport for init_process_group(\"auto\") (default auto)"},
      {"COMMGRAD_TIMEOUT", "seconds > 0", "group timeout when the program sets none (default 300)"},
      {"COMMGRAD_DEBUG", "1 or CHECK, TRACE, INFO",
       "1/CHECK: cross-rank check of every collective; TRACE: "
       "the check and a log line per collective; INFO: more log lines"},
      {"COMMGRAD_BUFFER_POOL_MB", "MiB >= 0",
       "freed collective buffers the pool keeps for reuse (default 512; 0 keeps none)"},
      {"COMMGRAD_SHM_CHUNK_BYTES", "bytes >= 0",
       "shm: pipeline chunk of large collectives (default 512 KiB at 2 ranks, else 256 KiB)"},
      {"COMMGRAD_SHM_SINGLE_COPY_BYTES", "bytes >= 0",
       "shm: all-reduces from this size read peers directly (default 0: never)"},
      {"COMMGRAD_SHM_SINGLE_COPY_MAX_BYTES", "bytes >= 0",
       "shm: ... up to this size (default 16 MiB; above it the pipelined staging is faster)"},
      {"COMMGRAD_SHM_SINGLE_COPY_PIECE_BYTES", "bytes >= 0",
       "shm: all-to-all pieces of this size and more are read from the sender directly (default 0: never)"},
      {"COMMGRAD_SHM_SPIN_US", "microseconds >= 0", "shm: how long a waiting rank spins before it sleeps"},
      {"COMMGRAD_SHM_ASYNC_BYTES", "bytes >= 0",
       "shm: collectives from this size run on the worker thread (default 1 MiB); smaller ones finish in the call"},
      {"COMMGRAD_SHM_EAGER_WORKER", "0 or 1", "shm: start async collectives at once (default: when cores are spare)"},
      {"COMMGRAD_SHM_STREAMING_STORES", "0, 1 or 2",
       "shm: large writes into the segment with 0 ordinary stores, 1 streaming (non-temporal) ones, 2 streaming "
       "while ordinary ones run slow (default)"},
      {"COMMGRAD_HOST", "any text",
       "this process's host identity for locality decisions (default: host name and boot id)"},
      {"COMMGRAD_LINE_BUFFERED", "1",
       "line-buffer stdout from the moment commgrad loads, so that a rank stopped by the launcher loses no printed "
       "line (commgrad-run sets it for its ranks; set it yourself under another launcher whose ranks write to a pipe)"},
      {"COMMGRAD_BACKTRACE", "0 or 1",
       "1: a rank that dies of an uncaught error also prints LibTorch's C++ backtrace (default: the message only)"},
      {"TORCHELASTIC_ERROR_FILE", "path",
       "where a rank that dies of an uncaught error writes it, in torchrun's JSON form, instead of printing it "
       "(commgrad-run and torchrun set it per rank and print each distinct error once)"},
      {"COMMGRAD_TRACE_BUFFER_SIZE", "collectives >= 0",
       "flight recorder: the last collectives each rank keeps (default 2000; 0: off)"},
      {"COMMGRAD_TRACE_DIR", "directory",
       "flight recorder: where ranks write their dumps (commgrad-run sets a fresh one per job; default "
       "./commgrad-trace)"},
      {"COMMGRAD_TRACE_SIGNAL", "USR2, USR1, a number, 0",
       "flight recorder: the signal that makes a rank dump (default USR2; 0: none)"},
      {"GLOO_SOCKET_IFNAME", "interface[,interface...]", "network interfaces Gloo binds to, as in PyTorch"},
  };
  return list;
}

std::optional<std::string> get(const std::string& name) {
  const auto& list = variables();
  const bool listed = std::any_of(list.begin(), list.end(), [&](const Variable& v) { return name == v.name; });
  TORCH_INTERNAL_ASSERT(listed, "commgrad reads the environment variable ", name,
                        ", which is missing from commgrad::env::variables()");
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::optional<int64_t> get_count(const std::string& name, const char* unit) {
  const auto value = get(name);
  if (!value || value->empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value->c_str(), &end, 10);
  TORCH_CHECK(end != value->c_str() && *end == '\0' && errno == 0 && parsed >= 0, "[commgrad] environment: ", name,
              "='", *value, "' is not a number of ", unit, " (expected an integer >= 0)");
  return parsed;
}

}  // namespace commgrad::env
