// The launcher's side of the elastic rendezvous (--nnodes MIN:MAX;
// rendezvous.h): opening it, and the news of a new round while the ranks run
// (the Launcher's members declared in launcher.h).

#include "launcher.h"

#include <signal.h>

#include <memory>
#include <string>

namespace commgrad::run {

bool Launcher::open_rendezvous() {
  rendezvous_ = std::make_unique<Rendezvous>(options_, job_id_);
  std::string error;
  if (!rendezvous_->open(&error)) {
    report(error);
    return false;
  }
  return true;
}

// --nnodes MIN:MAX while the ranks run: the rendezvous socket to watch for a
// new round, or -1.
int Launcher::watched_fd() const { return rendezvous_ && !stopping_ && !new_round_ ? rendezvous_->watch_fd() : -1; }

// Another node came to the rendezvous (host), or the host opened a new round
// (guest): this node's ranks stop and join it.
void Launcher::on_rendezvous_news() {
  if (!rendezvous_->new_round_wanted()) return;
  new_round_ = true;
  report(std::string(rendezvous_->hosting() ? "a node came to the rendezvous" : "the rendezvous opened a new round") +
         "; stopping " + ranks_phrase(running_count()) + " to join it");
  stop_ranks(SIGTERM);
}

}  // namespace commgrad::run
