#include "launcher.h"

// How the launcher keeps "no orphans, no zombies":
//  - every rank is the leader of its own process group, and every signal the
//    launcher sends goes to the whole group, so a rank's children get it too;
//  - when a rank's first process exits, whatever it left in its group is
//    SIGKILLed before the exit is reaped (the zombie keeps the group id from
//    being reused in between);
//  - the launcher is a child subreaper: descendants that left their group
//    (setsid, double fork) come back to it as orphans and are SIGKILLed once
//    all ranks are done;
//  - if the launcher is killed outright, PR_SET_PDEATHSIG kills each rank's
//    first process and the Watchdog process SIGKILLs the groups.

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

extern char** environ;

namespace commgrad::run {
namespace {

// After the last rank is reaped, how long its descendants may keep the
// output pipes open before the launcher stops reading them.
constexpr double kDrainSeconds = 2.0;
// How long the rendezvous may wait without a --timeout: a year.
constexpr double kNoDeadlineSeconds = 365.0 * 24 * 3600;
constexpr int kHandledSignals[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP};
constexpr int kNumHandled = sizeof(kHandledSignals) / sizeof(kHandledSignals[0]);

// The self-pipe; file-scope because signal handlers cannot reach an object.
int g_wake_read = -1;
int g_wake_write = -1;
struct sigaction g_old_actions[kNumHandled];
bool g_installed[kNumHandled] = {};
struct sigaction g_old_sigpipe;
bool g_sigpipe_installed = false;

extern "C" void wake_on_signal(int sig) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  ssize_t ignored = write(g_wake_write, &byte, 1);  // full pipe: a wake-up is pending anyway
  (void)ignored;
  errno = saved_errno;
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

}  // namespace

std::string ranks_phrase(int n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

Launcher::Launcher(LaunchOptions options) : options_(std::move(options)) {}

Launcher::~Launcher() {
  for (Rank& rank : ranks_) {
    close_pipe(rank, false);
    close_pipe(rank, true);
  }
  watchdog_.stop();
  restore_signal_handlers();
  if (devnull_ >= 0) close(devnull_);
}

void Launcher::report(const std::string& message) const {
  const std::string line = "commgrad-run: " + message + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
}

int Launcher::running_count() const {
  int n = 0;
  for (const Rank& rank : ranks_) n += rank.running ? 1 : 0;
  return n;
}

int Launcher::run() {
  const ResolvedProgram program = resolve_program(options_.program);
  if (program.exit_code != 0) {
    report("cannot execute '" + options_.program + "': " + program.error);
    return program.exit_code;
  }
  const bool one_node = options_.nnodes == 1 && !options_.elastic_nodes;
  job_id_ = !options_.rdzv_id.empty() ? options_.rdzv_id : one_node ? random_job_id() : "";
  node_rank_ = options_.node_rank;
  nnodes_ = options_.nnodes;
  if (options_.elastic_nodes && !open_rendezvous()) return kExitLaunchFailed;
  // First, so the watchdog holds no rank pipe and no self-pipe open and
  // cannot run our signal handlers.
  watchdog_.start();
  devnull_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull_ < 0 || !install_signal_handlers()) {
    report(std::string("cannot set up: ") + std::strerror(errno));
    return kExitLaunchFailed;
  }
  // Orphaned descendants come back to us instead of init (see top of file).
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  if (options_.timeout_s) {
    job_deadline_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*options_.timeout_s));
  }
  int code = run_attempt(program.path);
  while (should_restart()) {
    if (new_round_) {
      report("starting this node's ranks again in the new rendezvous round (not counted as a restart)");
    } else {
      ++restart_count_;
      report("restarting the job (restart " + std::to_string(restart_count_) + " of " +
             std::to_string(options_.max_restarts) + ")");
    }
    reset_attempt();
    code = run_attempt(program.path);
  }
  watchdog_.stop();
  restore_signal_handlers();
  return code;
}

// --nnodes MIN:MAX: this start's node rank, nodes and port from the
// rendezvous. Returns the exit code when the job ends here instead.
std::optional<int> Launcher::join_round() {
  const double time_left_s =
      job_deadline_ ? std::chrono::duration<double>(*job_deadline_ - Clock::now()).count() : kNoDeadlineSeconds;
  const RendezvousResult r = rendezvous_->next_round(
      g_wake_read,
      [this] {
        drain_signals();
        return exit_code_.has_value();
      },
      time_left_s);
  if (r.interrupted) return exit_code_.value_or(kExitLaunchFailed);
  if (r.timed_out) {
    report("job exceeded --timeout " + format_seconds(*options_.timeout_s) + "s in the rendezvous");
    return exit_code_ = kExitTimeout;
  }
  if (!r.ok) {
    report(r.error);
    return exit_code_ = kExitLaunchFailed;
  }
  node_rank_ = r.assignment.node_rank;
  nnodes_ = r.assignment.nodes;
  port_ = r.assignment.port;
  const auto [lo, hi] = *options_.elastic_nodes;
  report("rendezvous round " + std::to_string(r.assignment.round) + ": node " + std::to_string(node_rank_) + " of " +
         std::to_string(nnodes_) + " (--nnodes " + std::to_string(lo) + ":" + std::to_string(hi) + "), WORLD_SIZE " +
         std::to_string(nnodes_ * options_.nproc_per_node));
  return std::nullopt;
}

// One start of the job: every rank of this node, supervised to the end.
int Launcher::run_attempt(const std::string& path) {
  if (rendezvous_) {
    if (const auto code = join_round()) return *code;
  } else if (options_.master_port) {
    port_ = *options_.master_port;
  } else {
    std::string error;
    port_ = pick_free_port(options_.master_addr, &error);
    if (port_ < 0) {
      report(error);
      return kExitLaunchFailed;
    }
  }
  flight_records_ = prepare_flight_records();
  if (!error_files_.created()) error_files_.create();  // without it, ranks print their errors themselves
  ranks_.resize(static_cast<std::size_t>(options_.nproc_per_node));
  for (int r = 0; r < options_.nproc_per_node; ++r) {
    ranks_[r].rank = node_rank_ * options_.nproc_per_node + r;
    if (!spawn(ranks_[r], path)) {
      exit_code_ = kExitLaunchFailed;
      stop_ranks(SIGTERM);
      break;
    }
  }
  supervise();
  // A rank killed while a group was being set up can leave its shm segment.
  remove_job_segments(job_id_);
  if (signalled_ && other_failures_ == 0 && preempted_ > 0) exit_code_ = kExitPreempted;
  report_rank_errors();
  finish_flight_records(flight_records_, exit_code_.value_or(0) != 0,
                        [this](const std::string& line) { report(line); });
  return exit_code_.value_or(0);
}

// Each distinct error the ranks left, once, after their own output.
void Launcher::report_rank_errors() {
  std::vector<int> ranks;
  for (const Rank& rank : ranks_) ranks.push_back(rank.rank);
  for (const std::string& line : error_files_.report(ranks, first_failed_)) report(line);
}

// After a rank failed (not a signal, not the timeout, not preemption), with restarts left.
bool Launcher::should_restart() {
  if (new_round_ && !rank_failed_ && !signalled_ && exit_code_ != kExitTimeout) return true;
  if (!rank_failed_ || signalled_ || exit_code_ == kExitTimeout) return false;
  if (restart_count_ < options_.max_restarts) return true;
  if (options_.max_restarts > 0) {
    report("no restarts left (--max-restarts " + std::to_string(options_.max_restarts) + "); the job failed");
  }
  return false;
}

void Launcher::reset_attempt() {
  for (Rank& rank : ranks_) {
    close_pipe(rank, false);
    close_pipe(rank, true);
  }
  ranks_.clear();
  exit_code_.reset();
  first_failed_.reset();
  rank_failed_ = new_round_ = false;
  preempted_ = other_failures_ = 0;
  stopping_ = killed_ = orphan_check_due_ = false;
  kill_deadline_.reset();
  stop_deadline_.reset();
  drain_deadline_.reset();
}

bool Launcher::install_signal_handlers() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  g_wake_read = fds[0];
  g_wake_write = fds[1];
  for (int i = 0; i < kNumHandled; ++i) {
    const int sig = kHandledSignals[i];
    struct sigaction old {};
    sigaction(sig, nullptr, &old);
    // A signal ignored at startup (nohup, a background job) stays ignored.
    if (sig != SIGCHLD && old.sa_handler == SIG_IGN) continue;
    struct sigaction action {};
    action.sa_handler = wake_on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | (sig == SIGCHLD ? SA_NOCLDSTOP : 0);
    if (sigaction(sig, &action, &g_old_actions[i]) != 0) return false;
    g_installed[i] = true;
  }
  // A reader that went away must not kill the launcher while ranks run.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  g_sigpipe_installed = sigaction(SIGPIPE, &ignore, &g_old_sigpipe) == 0;
  return true;
}

void Launcher::restore_signal_handlers() {
  for (int i = 0; i < kNumHandled; ++i) {
    if (g_installed[i]) sigaction(kHandledSignals[i], &g_old_actions[i], nullptr);
    g_installed[i] = false;
  }
  if (g_sigpipe_installed) sigaction(SIGPIPE, &g_old_sigpipe, nullptr);
  g_sigpipe_installed = false;
  if (g_wake_read >= 0) close(g_wake_read);
  if (g_wake_write >= 0) close(g_wake_write);
  g_wake_read = g_wake_write = -1;
}

namespace {

// Everything a rank's child process needs, built before fork: after it, the
// child only makes async-signal-safe calls.
struct ExecPlan {
  std::string path;
  std::vector<std::string> env, args;
  std::vector<char*> envp, argv, sh_argv;
  std::string sh = "/bin/sh", script, error;

  ExecPlan(const std::string& program_path, const std::vector<std::string>& program_args,
           std::vector<std::string> environment, int rank)
      : path(program_path), env(std::move(environment)), args(program_args), script(program_path) {
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // execvp's fallback for a script without "#!": run it with /bin/sh.
    sh_argv = {sh.data(), script.data()};
    sh_argv.insert(sh_argv.end(), argv.begin() + 1, argv.end());
    error = "commgrad-run: rank " + std::to_string(rank) + ": cannot execute '" + path + "': ";
  }
  ExecPlan(const ExecPlan&) = delete;  // argv and envp point into it
  ExecPlan& operator=(const ExecPlan&) = delete;
};

// The child: its own process group, dies with the launcher, the signal
// handlers and mask it had before the launcher's, stdin from /dev/null and
// stdout/stderr into the pipes; then the program.
[[noreturn]] void run_child(const ExecPlan& plan, pid_t launcher_pid, const sigset_t& old_mask, int devnull, int out,
                            int err) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher_pid) _exit(kExitLaunchFailed);  // launcher died before prctl
  for (int i = 0; i < kNumHandled; ++i) {
    if (g_installed[i]) sigaction(kHandledSignals[i], &g_old_actions[i], nullptr);
  }
  if (g_sigpipe_installed) sigaction(SIGPIPE, &g_old_sigpipe, nullptr);
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  dup2(devnull, STDIN_FILENO);
  dup2(out, STDOUT_FILENO);
  dup2(err, STDERR_FILENO);
  execve(plan.path.c_str(), plan.argv.data(), plan.envp.data());
  if (errno == ENOEXEC) execve(plan.sh.c_str(), plan.sh_argv.data(), plan.envp.data());
  const char* reason = std::strerror(errno);
  ssize_t ignored = write(STDERR_FILENO, plan.error.data(), plan.error.size());
  ignored = write(STDERR_FILENO, reason, std::strlen(reason));
  ignored = write(STDERR_FILENO, "\n", 1);
  (void)ignored;
  _exit(kExitNotFound);
}

}  // namespace

std::vector<std::string> Launcher::rank_variables(const Rank& rank) const {
  const int n = options_.nproc_per_node;
  std::vector<std::pair<std::string, std::string>> vars = {
      {"RANK", std::to_string(rank.rank)},
      {"WORLD_SIZE", std::to_string(nnodes_ * n)},
      {"LOCAL_RANK", std::to_string(rank.rank - node_rank_ * n)},
      {"LOCAL_WORLD_SIZE", std::to_string(n)},
      {"GROUP_RANK", std::to_string(node_rank_)},
      {"GROUP_WORLD_SIZE", std::to_string(nnodes_)},
      {"MASTER_ADDR", options_.master_addr},
      {"MASTER_PORT", std::to_string(port_)},
      {"TORCHELASTIC_RUN_ID", job_id_.empty() ? "none" : job_id_},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count_)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts)},
      // commgrad line-buffers the rank's stdout (see src/dist/environment.cpp).
      {"COMMGRAD_LINE_BUFFERED", "1"},
  };
  if (const std::string file = error_files_.path_for(rank.rank); !file.empty()) {
    vars.push_back({"TORCHELASTIC_ERROR_FILE", file});
  }
  if (!flight_records_.dir.empty()) vars.emplace_back("COMMGRAD_TRACE_DIR", flight_records_.dir);
  return rank_environment(environ, vars);
}

bool Launcher::spawn(Rank& rank, const std::string& path) {
  std::vector<std::string> args = {options_.program};
  args.insert(args.end(), options_.args.begin(), options_.args.end());
  const ExecPlan plan(path, args, rank_variables(rank), rank.rank);
  int out[2];
  int err[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    report(std::string("pipe: ") + std::strerror(errno));
    return false;
  }
  if (pipe2(err, O_CLOEXEC) != 0) {
    report(std::string("pipe: ") + std::strerror(errno));
    close(out[0]);
    close(out[1]);
    return false;
  }
  // Signals stay blocked across fork so that our handlers (and their writes
  // to the self-pipe) never run in the child.
  sigset_t all;
  sigset_t old_mask;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &old_mask);
  const pid_t launcher_pid = getpid();
  const pid_t pid = fork();
  if (pid == 0) run_child(plan, launcher_pid, old_mask, devnull_, out[1], err[1]);
  const int fork_errno = errno;
  if (pid > 0) setpgid(pid, pid);  // both sides, so the group exists before either goes on
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  close(out[1]);
  close(err[1]);
  if (pid < 0) {
    close(out[0]);
    close(err[0]);
    report(std::string("fork: ") + std::strerror(fork_errno));
    return false;
  }
  adopt(rank, pid, out[0], err[0]);
  return true;
}

// The parent's side of a started rank: its pipes read without blocking,
// their lines forwarded (prefixed with the rank when asked), the watchdog told.
void Launcher::adopt(Rank& rank, pid_t pid, int out, int err) {
  fcntl(out, F_SETFL, fcntl(out, F_GETFL) | O_NONBLOCK);
  fcntl(err, F_SETFL, fcntl(err, F_GETFL) | O_NONBLOCK);
  rank.pid = pid;
  rank.running = true;
  rank.out_fd = out;
  rank.err_fd = err;
  const std::string prefix = options_.prefix ? std::string("[").append(std::to_string(rank.rank)).append("] ") : "";
  rank.out = std::make_unique<LineForwarder>(STDOUT_FILENO, prefix);
  rank.err = std::make_unique<LineForwarder>(STDERR_FILENO, prefix);
  watchdog_.watch(pid);
}

void Launcher::supervise() {
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, bool>> owners;  // fds[i + 1] is owners[i]'s stdout/stderr
  for (;;) {
    if (running_count() == 0) {
      if (orphan_check_due_) kill_orphans();
      bool any_open = false;
      for (const Rank& rank : ranks_) any_open = any_open || rank.out_fd >= 0 || rank.err_fd >= 0;
      if (!any_open) break;
      const Clock::time_point now = Clock::now();
      if (!drain_deadline_) {
        drain_deadline_ =
            now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kDrainSeconds));
      }
      if (now >= *drain_deadline_) break;  // held open by someone outside our tree
    }

    fds.assign(1, pollfd{g_wake_read, POLLIN, 0});
    owners.clear();
    for (Rank& rank : ranks_) {
      for (bool is_err : {false, true}) {
        const int fd = is_err ? rank.err_fd : rank.out_fd;
        if (fd < 0) continue;
        fds.push_back(pollfd{fd, POLLIN, 0});
        owners.emplace_back(&rank, is_err);
      }
    }
    const int watch = watched_fd();
    if (watch >= 0) fds.push_back(pollfd{watch, POLLIN, 0});  // last: the ranks' pipes keep their places
    const int rc = poll(fds.data(), fds.size(), poll_timeout_ms());
    if (rc < 0 && errno != EINTR) {
      report(std::string("poll: ") + std::strerror(errno) + "; killing all ranks");
      if (!exit_code_) exit_code_ = kExitLaunchFailed;
      stop_ranks(SIGKILL);
      killed_ = true;
      break;
    }
    if (rc > 0 && fds[0].revents != 0) drain_signals();
    for (std::size_t i = 0; rc > 0 && i < owners.size(); ++i) {
      if (fds[i + 1].revents == 0) continue;
      Rank& rank = *owners[i].first;
      const bool is_err = owners[i].second;
      // Skip a pipe that handling a signal above already closed.
      if ((is_err ? rank.err_fd : rank.out_fd) == fds[i + 1].fd) read_pipe(rank, is_err);
    }
    if (watch >= 0 && rc > 0 && fds.back().revents != 0) on_rendezvous_news();
    check_deadlines();
  }

  // Whatever is left: kill the last orphans, reap every child, flush output.
  for (int attempt = 0; attempt < 100; ++attempt) {
    kill_orphans();
    reap();
    std::vector<pid_t> known;
    if (watchdog_.pid() > 0) known.push_back(watchdog_.pid());
    if (orphaned_children(known).empty()) break;
    usleep(10 * 1000);
  }
  reap();
  for (Rank& rank : ranks_) {
    close_pipe(rank, false);
    close_pipe(rank, true);
  }
}

int Launcher::poll_timeout_ms() const {
  std::optional<Clock::time_point> next;
  const auto consider = [&next](const std::optional<Clock::time_point>& t) {
    if (t && (!next || *t < *next)) next = t;
  };
  if (!stopping_) consider(job_deadline_);
  if (stopping_ && !killed_) consider(kill_deadline_);
  consider(stop_deadline_);
  consider(drain_deadline_);
  if (!next) return -1;
  const auto left = std::chrono::duration<double, std::milli>(*next - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min(std::ceil(left), 3600.0 * 1000));
}

void Launcher::drain_signals() {
  unsigned char buf[256];
  for (;;) {
    const ssize_t n = read(g_wake_read, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    for (ssize_t i = 0; i < n; ++i) {
      if (buf[i] == SIGCHLD) {
        reap();
      } else {
        on_signal(buf[i]);
      }
    }
  }
}

void Launcher::reap() {
  // Ranks first, and among them those a signal ended: when a rank is killed
  // its peers fail because of it, and by the time the launcher looks, both
  // may be zombies, found in any order. The verdict names the cause.
  std::vector<std::pair<Rank*, siginfo_t>> exited;
  for (Rank& rank : ranks_) {
    siginfo_t info{};
    if (rank.running && waitid(P_PID, rank.pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == rank.pid) {
      exited.emplace_back(&rank, info);
    }
  }
  std::stable_partition(exited.begin(), exited.end(), [](const auto& e) { return e.second.si_code != CLD_EXITED; });
  for (auto& [rank, info] : exited) {
    kill(-rank->pid, SIGKILL);
    while (waitpid(rank->pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    on_rank_exit(*rank, info);
  }
  if (!exited.empty() && running_count() == 0) orphan_check_due_ = true;
  // Then every other child (the watchdog, a rank that exited meanwhile).
  for (;;) {
    // Peek first (WNOWAIT): while the rank is an unreaped zombie its process
    // group id cannot be reused, so killing the group cannot hit a stranger.
    siginfo_t info{};
    if (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0) return;
    if (info.si_pid == 0) return;
    const pid_t pid = info.si_pid;
    Rank* exited = nullptr;
    for (Rank& rank : ranks_) {
      if (rank.running && rank.pid == pid) exited = &rank;
    }
    if (exited != nullptr) kill(-pid, SIGKILL);
    if (pid == watchdog_.pid()) watchdog_.lost();
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    if (exited != nullptr) on_rank_exit(*exited, info);
    if (running_count() == 0) orphan_check_due_ = true;
  }
}

void Launcher::on_signal(int sig) {
  const int running = running_count();
  signalled_ = true;     // told to stop: no restart follows
  if (stop_deadline_) {  // a failure is stopping the job: forward the signal now
    stop_deadline_.reset();
    stop_ranks(sig);
  } else if (!stopping_) {
    if (running > 0) {
      report("received " + signal_name(sig) + "; forwarding it to " + ranks_phrase(running));
    }
    exit_code_ = 128 + sig;
    stop_ranks(sig);
  } else if (!killed_ && running > 0) {
    // Asked twice: do not wait out the grace period.
    report("received " + signal_name(sig) + " while stopping; sending SIGKILL to " + ranks_phrase(running));
    for (const Rank& rank : ranks_) signal_rank(rank, SIGKILL);
    killed_ = true;
  }
}

void Launcher::check_deadlines() {
  const Clock::time_point now = Clock::now();
  if (stop_deadline_ && now >= *stop_deadline_) {
    stop_deadline_.reset();
    stop_ranks(SIGTERM);
  }
  if (!stopping_ && job_deadline_ && now >= *job_deadline_) {
    report("job exceeded --timeout " + format_seconds(*options_.timeout_s) + "s; stopping " +
           ranks_phrase(running_count()));
    exit_code_ = kExitTimeout;
    stop_ranks(SIGTERM);
  }
  if (stopping_ && !killed_ && kill_deadline_ && now >= *kill_deadline_) {
    const int running = running_count();
    if (running > 0) {
      report(ranks_phrase(running) + " still running " + format_seconds(options_.grace_s) +
             "s after being told to stop; sending SIGKILL");
    }
    for (const Rank& rank : ranks_) signal_rank(rank, SIGKILL);
    killed_ = true;
  }
}

}  // namespace commgrad::run
