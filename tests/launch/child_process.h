#pragma once

// A small fork/exec helper for the launcher tests: runs a program with pipes
// on stdout and stderr, lets the test signal it mid-run, and never waits
// longer than told to (a test must fail, not hang).

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace commgrad::testing {

/// What a finished child did.
struct ChildResult {
  /// Exit code, or 128+signal when it was killed; -1 when it had to be
  /// killed because it ran past the test's limit.
  int code = -1;
  std::string out;
  std::string err;
  /// Seconds from start to exit.
  double seconds = 0;
};

/// One running child with captured stdout and stderr.
class ChildProcess {
 public:
  using Clock = std::chrono::steady_clock;

  /// Starts `argv`, with `env` applied to this process's environment
  /// (a value of std::nullopt removes the variable).
  explicit ChildProcess(const std::vector<std::string>& argv,
                        const std::map<std::string, std::optional<std::string>>& env = {}) {
    std::vector<std::string> env_storage;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      if (env.count(entry.substr(0, entry.find('='))) == 0) env_storage.push_back(entry);
    }
    for (const auto& [name, value] : env) {
      if (value) env_storage.push_back(name + "=" + *value);
    }
    std::vector<std::string> args = argv;
    std::vector<char*> argp;
    for (std::string& a : args) argp.push_back(a.data());
    argp.push_back(nullptr);
    std::vector<char*> envp;
    for (std::string& e : env_storage) envp.push_back(e.data());
    envp.push_back(nullptr);

    int out[2];
    int err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) std::abort();
    start_ = Clock::now();
    pid_ = fork();
    if (pid_ == 0) {
      // Whatever the test runner ignores, the launcher starts with defaults.
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD}) signal(sig, SIG_DFL);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      execve(argp[0], argp.data(), envp.data());
      _exit(250);
    }
    close(out[1]);
    close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
  }

  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  ~ChildProcess() {
    if (!reaped_ && pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) close(out_fd_);
    if (err_fd_ >= 0) close(err_fd_);
  }

  pid_t pid() const { return pid_; }
  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

  /// Reads output until stdout contains every one of `needles`; false after
  /// `timeout_s` or when the child exits first.
  bool wait_for_stdout(const std::vector<std::string>& needles, double timeout_s) {
    return wait_for(out_, needles, timeout_s);
  }
  /// The same for stderr.
  bool wait_for_stderr(const std::vector<std::string>& needles, double timeout_s) {
    return wait_for(err_, needles, timeout_s);
  }

  void send(int sig) { kill(pid_, sig); }

  /// Waits for the child to exit (killing it after `timeout_s`), then reads
  /// what is left in the pipes for at most a moment.
  ChildResult finish(double timeout_s) {
    const auto deadline = Clock::now() + to_duration(timeout_s);
    bool timed_out = false;
    while (!try_reap()) {
      if (Clock::now() >= deadline) {
        timed_out = true;
        kill(pid_, SIGKILL);
        waitpid(pid_, &status_, 0);
        reaped_ = true;
        exit_time_ = Clock::now();
        break;
      }
      pump(20);
    }
    // Output the launcher wrote is in the pipes; don't wait for leftovers
    // (which a test then reports) to close them.
    const auto drain_deadline = Clock::now() + to_duration(1.0);
    while ((out_fd_ >= 0 || err_fd_ >= 0) && Clock::now() < drain_deadline) pump(20);

    ChildResult result;
    result.out = out_;
    result.err = err_;
    result.seconds = std::chrono::duration<double>(exit_time_ - start_).count();
    if (timed_out) {
      result.code = -1;
    } else if (WIFEXITED(status_)) {
      result.code = WEXITSTATUS(status_);
    } else if (WIFSIGNALED(status_)) {
      result.code = 128 + WTERMSIG(status_);
    }
    return result;
  }

 private:
  static Clock::duration to_duration(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  }

  bool wait_for(const std::string& sink, const std::vector<std::string>& needles, double timeout_s) {
    const auto deadline = Clock::now() + to_duration(timeout_s);
    for (;;) {
      bool all = true;
      for (const std::string& n : needles) all = all && sink.find(n) != std::string::npos;
      if (all) return true;
      if (Clock::now() >= deadline || (reaped_ && out_fd_ < 0 && err_fd_ < 0)) return false;
      pump(20);
      try_reap();
    }
  }

  bool try_reap() {
    if (reaped_) return true;
    if (waitpid(pid_, &status_, WNOHANG) == pid_) {
      reaped_ = true;
      exit_time_ = Clock::now();
    }
    return reaped_;
  }

  void pump(int timeout_ms) {
    pollfd fds[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
    if (poll(fds, 2, timeout_ms) <= 0) return;
    read_into(out_fd_, fds[0].revents, out_);
    read_into(err_fd_, fds[1].revents, err_);
  }

  static void read_into(int& fd, short revents, std::string& sink) {
    if (fd < 0 || revents == 0) return;
    char buf[1 << 16];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
      sink.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      close(fd);
      fd = -1;
    }
  }

  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  int status_ = 0;
  bool reaped_ = false;
  Clock::time_point start_;
  Clock::time_point exit_time_;
  std::string out_;
  std::string err_;
};

/// Pids of live processes whose command line (arguments joined by spaces)
/// contains `marker`, or is exactly `marker` when `exact`.
inline std::vector<pid_t> processes_with(const std::string& marker, bool exact = false) {
  std::vector<pid_t> found;
  DIR* dir = opendir("/proc");
  if (dir == nullptr) return found;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long pid = std::strtol(entry->d_name, &end, 10);
    if (*end != '\0' || pid <= 0 || pid == getpid()) continue;
    // Plain read(): iostreams throw when the process vanishes mid-read.
    std::string cmdline;
    const int fd = open((std::string("/proc/") + entry->d_name + "/cmdline").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    char buf[4096];
    for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) cmdline.append(buf, n);
    close(fd);
    if (!cmdline.empty() && cmdline.back() == '\0') cmdline.pop_back();
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;  // zombies have an empty one
    const bool match = exact ? cmdline == marker : cmdline.find(marker) != std::string::npos;
    if (match) found.push_back(static_cast<pid_t>(pid));
  }
  closedir(dir);
  return found;
}

/// Waits up to `timeout_s` until `count` processes have exactly the command
/// line `cmdline`; false if they never do.
inline bool wait_for_processes(const std::string& cmdline, std::size_t count, double timeout_s) {
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  while (processes_with(cmdline, /*exact=*/true).size() < count) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

/// Waits up to `timeout_s` for every process with `marker` to be gone;
/// returns (and SIGKILLs, so one failure does not leak into the next test)
/// those that are not.
inline std::vector<pid_t> leftovers(const std::string& marker, double timeout_s) {
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  std::vector<pid_t> found = processes_with(marker);
  while (!found.empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    found = processes_with(marker);
  }
  for (pid_t pid : found) kill(pid, SIGKILL);
  return found;
}

}  // namespace commgrad::testing
