// The preemption flag: a signal handler that records the first signal and
// re-arms the default action (so that a second one ends the process), and a
// one-integer all-reduce that makes every rank see a signal any rank got.

#include "commgrad/checkpoint/preemption.h"

#include "commgrad/ops/raw.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace commgrad::checkpoint {
namespace {

std::atomic<int> g_received{0};
std::atomic<bool> g_installed{false};

extern "C" void on_preemption_signal(int sig) {
  int none = 0;
  g_received.compare_exchange_strong(none, sig);
  std::signal(sig, SIG_DFL);  // the second one is not caught
}

}  // namespace

Preemption::Preemption(PreemptionOptions options) : signals_(options.signals()) {
  TORCH_CHECK(!g_installed.exchange(true), "[commgrad] checkpoint::Preemption: one is already installed");
  g_received = 0;
  previous_.resize(signals_.size());
  for (size_t i = 0; i < signals_.size(); ++i) {
    struct sigaction action {};
    action.sa_handler = on_preemption_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    TORCH_CHECK(sigaction(signals_[i], &action, &previous_[i]) == 0,
                "[commgrad] checkpoint::Preemption: ", "cannot handle signal ", signals_[i]);
  }
}

Preemption::~Preemption() {
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  g_installed = false;
}

int Preemption::received() const { return g_received.load(); }

bool Preemption::requested(const Group& group) const {
  const at::Tensor flag = at::full({1}, static_cast<int64_t>(received() != 0 ? 1 : 0), at::kLong);
  return ops::raw::all_reduce(flag, ops::AllReduceOptions().op(ReduceOp::kMax), group).wait().item<int64_t>() != 0;
}

}  // namespace commgrad::checkpoint
