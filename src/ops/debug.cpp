// The switch of the cross-rank debug check (ops/debug.h).

#include "commgrad/ops/debug.h"

#include "commgrad/util/logging.h"

#include <atomic>

namespace commgrad::ops {
namespace {

// -1: follow COMMGRAD_DEBUG; 0/1: set by set_debug_checks().
std::atomic<int> g_debug_override{-1};

}  // namespace

bool debug_checks() {
  const int o = g_debug_override.load();
  return o >= 0 ? o == 1 : debug_checks_requested();
}

void set_debug_checks(std::optional<bool> enabled) { g_debug_override.store(enabled ? (*enabled ? 1 : 0) : -1); }

}  // namespace commgrad::ops
