// How the launcher stops its ranks: SIGTERM (after the stop delay when a
// rank failed), SIGKILL after the grace period, and the orphans a rank
// left behind (the Launcher's members declared in launcher.h).

#include "launcher.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <vector>

namespace commgrad::run {

void Launcher::stop_ranks(int sig) {
  stopping_ = true;
  for (const Rank& rank : ranks_) {
    signal_rank(rank, sig);
    // A stopped rank could not act on the signal until continued.
    if (sig != SIGKILL) signal_rank(rank, SIGCONT);
  }
  kill_deadline_ =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.grace_s));
}

// A failed rank's peers often fail alike a moment later; SIGTERM waits the
// stop delay, so that what they are writing reaches the log (torchrun's
// agent notices a failure only at its next monitor interval, too). The
// verdict is the first failure's either way.
void Launcher::stop_ranks_after_delay() {
  stopping_ = true;
  if (options_.stop_delay_s <= 0) {
    stop_ranks(SIGTERM);
    return;
  }
  stop_deadline_ =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.stop_delay_s));
}

void Launcher::signal_rank(const Rank& rank, int sig) {
  if (!rank.running) return;
  kill(-rank.pid, sig);
  // A rank that moved itself to another group (setsid) is signalled by pid;
  // it is our unreaped child, so the pid cannot belong to anyone else.
  if (getpgid(rank.pid) != rank.pid) kill(rank.pid, sig);
}

void Launcher::kill_orphans() {
  orphan_check_due_ = false;
  std::vector<pid_t> known;
  if (watchdog_.pid() > 0) known.push_back(watchdog_.pid());
  for (const Rank& rank : ranks_) {
    if (rank.running) known.push_back(rank.pid);
  }
  for (pid_t pid : orphaned_children(known)) kill(pid, SIGKILL);
}

}  // namespace commgrad::run
