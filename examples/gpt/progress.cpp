#include "progress.h"

#include <unistd.h>

namespace gpt {

Progress::Progress(int first_step, int last_step, int64_t tokens, std::FILE* out)
    : first_(first_step),
      last_(last_step),
      tokens_(tokens),
      out_(out),
      terminal_(isatty(fileno(out)) != 0),
      start_(std::chrono::steady_clock::now()) {}

double Progress::tokens_per_second() const {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  return seconds > 0 ? static_cast<double>(done_ * tokens_) / seconds : 0.0;
}

void Progress::step(int step, double loss) {
  ++done_;
  const double rate = tokens_per_second();
  const int left = last_ - step;
  const double eta = rate > 0 ? static_cast<double>(left * tokens_) / rate : 0.0;
  if (terminal_) {
    std::fprintf(out_, "\rstep %d/%d  loss %.6f  %.0f tokens/s  ETA %.0f s   ", step, last_, loss, rate, eta);
  } else {
    std::fprintf(out_, "step %d/%d: loss %.6f, %.0f tokens/s, ETA %.0f s\n", step, last_, loss, rate, eta);
  }
  std::fflush(out_);
}

void Progress::finish() {
  if (terminal_ && done_ > 0) std::fprintf(out_, "\n");
  std::fflush(out_);
}

}  // namespace gpt
