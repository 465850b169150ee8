#include "commgrad/util/logging.h"

#include "commgrad/util/env.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>

namespace commgrad {
namespace {

// COMMGRAD_DEBUG, read once: the log level and whether collectives check
// their fingerprints across ranks (docs/launching.md lists the values).
struct DebugSetting {
  LogLevel level = LogLevel::kWarn;
  bool checks = false;
};

DebugSetting read_debug_setting() {
  DebugSetting d;
  const auto v = env::get("COMMGRAD_DEBUG");
  if (!v) return d;
  const char* s = v->c_str();
  if (strcasecmp(s, "TRACE") == 0) d.level = LogLevel::kTrace;
  if (strcasecmp(s, "INFO") == 0) d.level = LogLevel::kInfo;
  d.checks = std::strcmp(s, "1") == 0 || strcasecmp(s, "CHECK") == 0 || strcasecmp(s, "TRACE") == 0;
  return d;
}

const DebugSetting& debug_setting() {
  static const DebugSetting setting = read_debug_setting();
  return setting;
}

std::atomic<int> g_rank{-1};

}  // namespace

LogLevel log_level() { return debug_setting().level; }

bool debug_checks_requested() { return debug_setting().checks; }

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
