#include "commgrad/util/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>

namespace commgrad {
namespace {

LogLevel read_level() {
  const char* v = std::getenv("COMMGRAD_DEBUG");
  if (v == nullptr) return LogLevel::kWarn;
  if (strcasecmp(v, "TRACE") == 0) return LogLevel::kTrace;
  if (strcasecmp(v, "INFO") == 0) return LogLevel::kInfo;
  return LogLevel::kWarn;
}

std::atomic<int> g_rank{-1};

}  // namespace

LogLevel log_level() {
  static const LogLevel level = read_level();
  return level;
}

void set_log_rank(int rank) { g_rank.store(rank); }
int log_rank() { return g_rank.load(); }

void log_message(LogLevel level, const std::string& message) {
  static const char* kNames[] = {"WARN", "INFO", "TRACE"};
  std::string line = "[commgrad";
  if (log_rank() >= 0) line += " rank " + std::to_string(log_rank());
  line += "] ";
  line += kNames[static_cast<int>(level)];
  line += " " + message + "\n";
  // One write so that lines from concurrent threads do not interleave.
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace commgrad
