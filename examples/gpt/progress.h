#pragma once
// Rank 0's report of a training run: one line that updates in place on a
// terminal (step, loss, tokens/s, ETA), plain lines otherwise (a log file,
// the launcher's pipes).

#include <chrono>
#include <cstdio>
#include <string>

namespace gpt {

class Progress {
 public:
  /// Steps first_step..last_step (1-based, inclusive), `tokens` per step.
  Progress(int first_step, int last_step, int64_t tokens, std::FILE* out = stdout);
  /// Step `step` ended with `loss`.
  void step(int step, double loss);
  /// Ends the line on a terminal.
  void finish();
  /// Tokens per second of the steps so far.
  double tokens_per_second() const;

 private:
  int first_, last_;
  int64_t tokens_;
  std::FILE* out_;
  bool terminal_;
  int done_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace gpt
