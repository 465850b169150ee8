// What the launcher does with its ranks' output and exits: lines forwarded
// as they come, and the verdict on a rank that ended (the Launcher's
// members declared in launcher.h).

#include "launcher.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>

namespace commgrad::run {

void Launcher::on_rank_exit(Rank& rank, const siginfo_t& info) {
  rank.running = false;
  // Show what the rank wrote before it died ahead of the verdict on it.
  read_pipe(rank, false);
  read_pipe(rank, true);
  const bool exited = info.si_code == CLD_EXITED;
  if (exited && info.si_status == 0) return;
  const bool preempted = exited && info.si_status == kExitPreempted;
  (preempted ? preempted_ : other_failures_) += 1;
  if (stopping_) return;

  std::string what;
  if (preempted) {
    what = "was preempted (exit code " + std::to_string(kExitPreempted) + ": it saved a checkpoint; not a failure)";
  } else if (exited) {
    what = "exited with code " + std::to_string(info.si_status);
  } else {
    what = "was killed by signal " + signal_name(info.si_status) + " (" + std::to_string(info.si_status) +
           (info.si_code == CLD_DUMPED ? ", core dumped" : "") + ")";
  }
  const int others = running_count();
  std::string message = "rank " + std::to_string(rank.rank) + " (pid " + std::to_string(rank.pid) + ") " + what;
  if (others > 0) message += "; stopping the other " + ranks_phrase(others);
  report(message);
  first_failed_ = rank.rank;
  exit_code_ = exited ? info.si_status : 128 + info.si_status;
  rank_failed_ = !preempted;
  stop_ranks_after_delay();
}

bool Launcher::read_pipe(Rank& rank, bool is_err) {
  static char buf[1 << 16];
  // Bounded, so one chatty rank cannot starve the others or the signals.
  for (int i = 0; i < 16; ++i) {
    const int fd = is_err ? rank.err_fd : rank.out_fd;
    if (fd < 0) return false;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
      (is_err ? rank.err : rank.out)->feed(buf, static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return true;
    } else {
      close_pipe(rank, is_err);  // EOF (or an error, which ends the stream too)
      return false;
    }
  }
  return true;
}

void Launcher::close_pipe(Rank& rank, bool is_err) {
  int& fd = is_err ? rank.err_fd : rank.out_fd;
  if (fd < 0) return;
  std::unique_ptr<LineForwarder>& forwarder = is_err ? rank.err : rank.out;
  if (forwarder) forwarder->finish();
  close(fd);
  fd = -1;
}

}  // namespace commgrad::run
