#pragma once
// Rank-aware logging to stderr, with the level read once from the environment.

#include <c10/util/StringUtil.h>

#include <string>

namespace commgrad {

/// How much commgrad says: kWarn (default), kInfo or kTrace, set by
/// `COMMGRAD_DEBUG=INFO` or `COMMGRAD_DEBUG=TRACE` (read once, like NCCL_DEBUG).
enum class LogLevel { kWarn = 0, kInfo = 1, kTrace = 2 };

/// The level in force.
LogLevel log_level();

/// True when COMMGRAD_DEBUG asks for the cross-rank check of every
/// collective (1, CHECK or TRACE; read once, with the level). See ops/debug.h.
bool debug_checks_requested();

/// The rank that prefixes log lines (set by init_process_group; -1 before).
void set_log_rank(int rank);
int log_rank();

/// Writes `[commgrad rank r] message` as one line to stderr.
void log_message(LogLevel level, const std::string& message);

}  // namespace commgrad

/// COMMGRAD_LOG(kInfo, "joined ", n, " ranks") — formatted only when enabled.
#define COMMGRAD_LOG(level, ...)                                                     \
  do {                                                                               \
    if (::commgrad::log_level() >= ::commgrad::LogLevel::level) {                    \
      ::commgrad::log_message(::commgrad::LogLevel::level, ::c10::str(__VA_ARGS__)); \
    }                                                                                \
  } while (0)

/// COMMGRAD_LOG0: like COMMGRAD_LOG, but only rank 0 (or an uninitialised process) speaks.
#define COMMGRAD_LOG0(level, ...)                                      \
  do {                                                                 \
    if (::commgrad::log_rank() <= 0) COMMGRAD_LOG(level, __VA_ARGS__); \
  } while (0)
