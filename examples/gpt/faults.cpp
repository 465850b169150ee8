#include "gpt/faults.h"

#include <csignal>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <unistd.h>

namespace gpt {

// grad-scale:F[:NAME]
Faults Faults::grad_scale(const char* text) {
  const char* number = text + std::strlen("grad-scale:");
  char* end = nullptr;
  Faults f;
  f.kind_ = "grad-scale";
  f.factor_ = std::strtod(number, &end);
  // F may be nan (a NaN gradient that --check must catch), not inf.
  if (end == number || std::isinf(f.factor_) || (*end != '\0' && *end != ':') || (*end == ':' && end[1] == '\0')) {
    throw std::invalid_argument(std::string("GPT_TRAIN_FAULT='") + text +
                                "': expected grad-scale:F or grad-scale:F:NAME (F a number or nan, NAME a parameter)");
  }
  if (*end == ':') f.parameter_ = end + 1;
  return f;
}

void Faults::scale_gradients(const std::vector<commgrad::checkpoint::TensorPiece>& gradients) const {
  if (kind_ != "grad-scale") return;
  for (const auto& g : gradients) {
    if (parameter_.empty() || g.name == parameter_) g.tensor.mul_(factor_);
  }
}

Faults Faults::from_environment() {
  Faults f;
  const char* text = std::getenv("GPT_TRAIN_FAULT");
  if (text == nullptr || *text == '\0') return f;
  if (std::string(text).rfind("grad-scale:", 0) == 0) return grad_scale(text);
  char kind[32] = {};
  int step = -1;
  int starts = 1;
  const int n = std::sscanf(text, "%31[a-z-]:%d:%d", kind, &step, &starts);
  f.kind_ = kind;
  f.step_ = step;
  f.starts_ = starts;
  const bool known = f.kind_ == "kill" || f.kind_ == "preempt" || f.kind_ == "preempt-twice" || f.kind_ == "kill-node";
  if (n < 2 || !known || step < 1 || starts < 1) {
    throw std::invalid_argument(
        std::string("GPT_TRAIN_FAULT='") + text +
        "': expected kill:N[:R], preempt:N, preempt-twice:N, kill-node:N or grad-scale:F[:NAME]");
  }
  return f;
}

void Faults::step_begins(int step, int rank) const {
  if (kind_ == "kill-node") {
    kill_node(step, rank);
    return;
  }
  if (rank != 0 || step != step_) return;
  if (kind_ == "kill") {
    const char* count = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if ((count == nullptr ? 0 : std::atoi(count)) >= starts_) return;
    std::printf("fault: rank 0 kills itself (SIGKILL) as step %d begins\n", step);
    std::fflush(stdout);
    ::kill(::getpid(), SIGKILL);
  } else if (kind_ == "preempt" || kind_ == "preempt-twice") {
    std::printf("fault: rank 0 sends SIGTERM to the launcher as step %d begins\n", step);
    std::fflush(stdout);
    ::kill(::getppid(), SIGTERM);
  }
}

void Faults::kill_node(int step, int rank) const {
  const char* count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const char* world = std::getenv("WORLD_SIZE");
  if (step != step_ || (count != nullptr && std::atoi(count) > 0) || world == nullptr || rank != std::atoi(world) - 1) {
    return;
  }
  std::printf("fault: rank %d kills its launcher (SIGKILL) as step %d begins\n", rank, step);
  std::fflush(stdout);
  ::kill(::getppid(), SIGKILL);
}

void Faults::preemption_save_begins(int rank) const {
  if (rank != 0 || kind_ != "preempt-twice") return;
  std::printf("fault: rank 0 sends a second SIGTERM to the launcher as the save begins\n");
  std::fflush(stdout);
  ::kill(::getppid(), SIGTERM);
}

}  // namespace gpt
