#pragma once
// The multi-process harness: runs a command (usually commgrad-run with an
// example or test program) with a hard timeout and captures its output.

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace commgrad::testing {

/// What a finished (or killed) command left behind.
struct ProcessResult {
  int exit_code = -1;      // 128+signal when killed by a signal
  bool timed_out = false;  // killed by run_process's own timeout
  std::string out;
  std::string err;
  double seconds = 0;
};

/// Runs argv[0] (searched in PATH) with `env` added to (or, for empty values,
/// removed from) this process's environment. The command runs in its own
/// process group, which is SIGKILLed when `timeout` passes.
ProcessResult run_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
                          std::chrono::milliseconds timeout = std::chrono::seconds(60));

/// Path of a built artefact: `$COMMGRAD_BUILD_DIR/<relative>`.
std::string build_path(const std::string& relative);

/// Path of commgrad-run (`$COMMGRAD_RUN`, else `$COMMGRAD_BUILD_DIR/bin/commgrad-run`).
std::string launcher_path();

/// An environment for run_process that removes every launcher's variables
/// (torchrun, mpirun, Slurm: the test may itself run under one) and
/// COMMGRAD_BACKEND, then sets `extra`.
std::map<std::string, std::string> clean_env(const std::map<std::string, std::string>& extra = {});

/// A TCP port on the loopback interface that was free a moment ago.
int free_port();

/// Runs `program args` once per rank on this machine as a job of
/// host_of_rank.size() ranks spread over pretend hosts: rank q runs with
/// COMMGRAD_HOST=host<host_of_rank[q]>, RANK, WORLD_SIZE, LOCAL_RANK and
/// LOCAL_WORLD_SIZE of its host, MASTER_ADDR/MASTER_PORT on loopback and `env`
/// (on top of clean_env()); its output lines start with "[q] ". Fails when any rank does.
ProcessResult run_on_hosts(const std::vector<int>& host_of_rank, const std::string& program, const std::string& args,
                           const std::map<std::string, std::string>& env,
                           std::chrono::milliseconds timeout = std::chrono::seconds(120));

/// Lines of `text` that start with `prefix`.
std::vector<std::string> lines_with_prefix(const std::string& text, const std::string& prefix);

}  // namespace commgrad::testing
