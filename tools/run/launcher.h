#pragma once

// The launcher: starts the ranks, forwards their output and signals, and
// stops the whole job when one rank fails, the time runs out, or it is told to.

#include <sys/types.h>

#include <chrono>
#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "error_files.h"
#include "flight_records.h"
#include "options.h"
#include "output.h"
#include "process.h"
#include "rendezvous.h"

namespace commgrad::run {

/// Exit code when the job ran past `--timeout` (as timeout(1)).
constexpr int kExitTimeout = 124;
/// Exit code when the launcher itself failed (fork, pipe, port).
constexpr int kExitLaunchFailed = 1;
/// Exit code of a rank that was preempted: told to stop (SIGTERM, SIGUSR1),
/// it saved a checkpoint and exited. Not a failure: no restart is spent on
/// it, and commgrad-run exits with it too (EX_TEMPFAIL of sysexits.h).
constexpr int kExitPreempted = 75;

/// "1 rank", "3 ranks".
std::string ranks_phrase(int n);

/// Runs one node's share of a job to the end.
///
/// All waiting happens in one poll() loop over the ranks' output pipes and a
/// self-pipe fed by the signal handlers (SIGCHLD, SIGINT, SIGTERM, SIGHUP),
/// so the handlers do nothing but write() one byte.
///
/// Example:
///   LaunchOptions options;
///   if (auto code = parse_options(argc, argv, options)) return *code;
///   return Launcher(options).run();
class Launcher {
 public:
  explicit Launcher(LaunchOptions options);
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;
  ~Launcher();

  /// Starts the ranks, supervises them until every one is reaped and every
  /// pipe is drained, and returns the exit code for the launcher.
  int run();

 private:
  using Clock = std::chrono::steady_clock;

  struct Rank {
    int rank = 0;          // global RANK
    pid_t pid = -1;        // also its process group id
    bool running = false;  // started and not yet reaped
    int out_fd = -1;       // read ends of its stdout / stderr pipes
    int err_fd = -1;
    std::unique_ptr<LineForwarder> out;
    std::unique_ptr<LineForwarder> err;
  };

  int run_attempt(const std::string& path);
  bool open_rendezvous();
  std::optional<int> join_round();
  void reset_attempt();
  bool should_restart();
  int watched_fd() const;
  void on_rendezvous_news();
  bool install_signal_handlers();
  void restore_signal_handlers();
  bool spawn(Rank& rank, const std::string& path);
  std::vector<std::string> rank_variables(const Rank& rank) const;  // the environment of a rank
  void adopt(Rank& rank, pid_t pid, int out, int err);
  void supervise();
  int poll_timeout_ms() const;
  void drain_signals();
  void reap();
  void on_rank_exit(Rank& rank, const siginfo_t& info);
  void on_signal(int sig);
  void check_deadlines();
  bool read_pipe(Rank& rank, bool is_err);
  void close_pipe(Rank& rank, bool is_err);
  void stop_ranks(int sig);
  void stop_ranks_after_delay();
  void signal_rank(const Rank& rank, int sig);
  void kill_orphans();
  int running_count() const;
  void report(const std::string& message) const;
  void report_rank_errors();

  LaunchOptions options_;
  int port_ = 0;
  std::string job_id_;                      // TORCHELASTIC_RUN_ID ("" across nodes without --rdzv-id)
  int restart_count_ = 0;                   // TORCHELASTIC_RESTART_COUNT of the ranks running now
  int node_rank_ = 0;                       // GROUP_RANK of this start (--node-rank, or the rendezvous's)
  int nnodes_ = 1;                          // nodes of this start (--nnodes, or the rendezvous's round)
  std::unique_ptr<Rendezvous> rendezvous_;  // --nnodes MIN:MAX only
  std::vector<Rank> ranks_;
  Watchdog watchdog_;
  ErrorFiles error_files_;           // where ranks leave an uncaught error
  std::optional<int> first_failed_;  // the rank whose failure stopped the job
  int devnull_ = -1;
  FlightRecords flight_records_;  // where ranks dump their flight records

  // Set once per start, by the first of: a failed rank, a signal, the timeout.
  std::optional<int> exit_code_;
  bool rank_failed_ = false;  // the verdict is a rank's failure (a restart may follow)
  bool new_round_ = false;    // the rendezvous opened a new round: start again, uncounted
  bool signalled_ = false;    // the launcher was told to stop (never restarted)
  int preempted_ = 0;         // ranks that exited with kExitPreempted
  int other_failures_ = 0;    // ranks that exited otherwise non-zero
  bool stopping_ = false;
  bool killed_ = false;  // SIGKILL already sent after the grace period
  std::optional<Clock::time_point> job_deadline_;
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> stop_deadline_;  // a failure's SIGTERM, after the stop delay
  std::optional<Clock::time_point> drain_deadline_;
  bool orphan_check_due_ = false;
};

}  // namespace commgrad::run
