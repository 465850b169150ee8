#pragma once

// POSIX helpers for commgrad-run: finding the program, picking a port, the
// ranks' environment, naming signals, and the watchdog that takes the ranks
// down when the launcher itself is killed.

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace commgrad::run {

/// Exit codes for a program that cannot be started (as in POSIX shells).
constexpr int kExitNotExecutable = 126;
constexpr int kExitNotFound = 127;

/// A program looked up like execvp does: the path to exec, or why it cannot.
struct ResolvedProgram {
  /// Path to pass to execve; empty when the program cannot be started.
  std::string path;
  /// 0 when found, else kExitNotFound or kExitNotExecutable.
  int exit_code = 0;
  /// Why not, e.g. "not found in PATH" or "Permission denied".
  std::string error;
};

/// Looks `program` up in PATH (or takes it as a path when it has a '/') and
/// checks that it is an executable regular file.
///
/// Example:
///   auto r = resolve_program("sleep");   // r.path == "/usr/bin/sleep"
ResolvedProgram resolve_program(const std::string& program);

/// Binds a TCP socket to port 0 on `addr`, reads the port the kernel chose,
/// and closes it. Returns the port, or -1 with `*error` set.
int pick_free_port(const std::string& addr, std::string* error);

/// "SIGKILL" for 9; "signal 42" for a signal without a name here.
std::string signal_name(int sig);

/// Writes all of `data` to `fd`, retrying short writes and EINTR (and
/// waiting with poll on EAGAIN). Returns false on an error such as EPIPE.
bool write_all(int fd, const char* data, std::size_t size);

/// The environment of one rank: `parent` minus the variables of other
/// launchers (OMPI_COMM_WORLD_*, SLURM_PROCID/NTASKS/LOCALID) and minus the
/// names in `vars`, plus `vars`, plus OMP_NUM_THREADS=1 when `parent` has none.
std::vector<std::string> rank_environment(const char* const* parent,
                                          const std::vector<std::pair<std::string, std::string>>& vars);

/// 16 random hexadecimal digits: a job id for TORCHELASTIC_RUN_ID.
std::string random_job_id();

/// Removes what the job `job_id` left in /dev/shm: commgrad's shm segments
/// are named "commgrad-shm-<job id>-<random>" under a launcher that sets
/// TORCHELASTIC_RUN_ID, and a rank killed while a group was being set up can
/// leave one. Returns how many were removed (none for an empty id).
int remove_job_segments(const std::string& job_id);

/// Children of this process that are not in `known`: descendants orphaned by
/// a rank and re-parented here (the launcher is a child subreaper).
std::vector<pid_t> orphaned_children(const std::vector<pid_t>& known);

/// A helper process that SIGKILLs the ranks' process groups when the
/// launcher dies without saying goodbye (e.g. `kill -9`). PR_SET_PDEATHSIG
/// only reaches each rank's first process; the watchdog reaches the
/// processes that rank started too.
///
/// Example:
///   Watchdog dog;
///   dog.start();          // before any rank pipe exists
///   dog.watch(rank_pid);  // after each fork
///   dog.stop();           // job over: it exits without killing anything
class Watchdog {
 public:
  Watchdog() = default;
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog();

  /// Forks the watchdog; false when that failed (ranks then rely on
  /// PR_SET_PDEATHSIG alone).
  bool start();
  /// Adds a rank's process group to those killed if the launcher dies.
  void watch(pid_t pgid);
  /// Tells the watchdog the job is over and reaps it.
  void stop();
  /// The watchdog's pid, or -1.
  pid_t pid() const { return pid_; }
  /// Forget a watchdog that died on its own (it was reaped elsewhere).
  void lost() { pid_ = -1; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;  // write end; its EOF is the watchdog's cue
};

}  // namespace commgrad::run
