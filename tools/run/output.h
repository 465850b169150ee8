#pragma once

// Line buffering of one rank's stdout or stderr on its way to the launcher's.

#include <cstddef>
#include <string>
#include <utility>

namespace commgrad::run {

/// Copies one stream of one rank to `out_fd` a whole line at a time, each
/// line prefixed with `prefix` (e.g. "[3] "), so that lines of different
/// ranks never interleave mid-line. With an empty prefix the bytes pass
/// through unchanged.
///
/// Example:
///   LineForwarder fwd(STDOUT_FILENO, "[1] ");
///   fwd.feed("a\nb", 3);   // writes "[1] a\n"
///   fwd.finish();          // writes "[1] b\n"
class LineForwarder {
 public:
  LineForwarder(int out_fd, std::string prefix) : out_fd_(out_fd), prefix_(std::move(prefix)) {}

  /// Writes every complete line in what has arrived so far.
  void feed(const char* data, std::size_t size);
  /// At EOF: writes what is left, ending it with a newline when prefixing.
  void finish();

 private:
  void emit(std::string& text);

  int out_fd_;
  std::string prefix_;
  std::string pending_;  // the unterminated tail of the stream
};

}  // namespace commgrad::run
