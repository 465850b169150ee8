// The terminate handler that names the collective in flight (see the header).

#include "commgrad/dist/terminate_handler.h"

#include "commgrad/dist/flight_recorder.h"
#include "commgrad/dist/group.h"

#include <atomic>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <mutex>
#include <string>

namespace commgrad {
namespace {

std::terminate_handler g_previous = nullptr;
std::atomic<bool> g_installed{false};

// Names the last collective started when the process is terminated (by an
// exception nobody could catch, e.g. in a transport's I/O thread), then lets
// the previous handler print the exception and abort.
[[noreturn]] void terminate_with_context() {
  std::string what = "an uncaught exception";
  if (const auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = ex.what();
    } catch (...) {
    }
  }
  // Only while a collective is in flight (or failed): an error that has
  // nothing to do with communication (a layer's shape error thrown after the
  // last collective finished) blames none.
  const detail::InFlight last = detail::collective_in_flight();
  if (last.op != nullptr) {
    const auto state = last.group.lock();
    std::cerr << "[commgrad] " << last.op << " " << (state ? Group(state).describe() : std::string("(group gone)"))
              << ": the process is terminating (" << what << ") while collective #" << last.sequence
              << " had not completed";
    if (what.find("op.preamble.length <= op.nbytes") != std::string::npos) {
      std::cerr << ". Gloo aborts like this when another rank called a collective with more data than this rank; "
                   "set COMMGRAD_DEBUG=1 on every rank to check each collective across ranks and raise an error on "
                   "all of them instead";
    }
    std::cerr << std::endl;
    for (const auto& path : detail::try_dump_flight_recorder("terminate: " + what)) {
      std::cerr << "[commgrad] flight record written to " << path << std::endl;
    }
  }
  if (g_previous != nullptr) g_previous();
  std::abort();
}

}  // namespace

void install_terminate_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_previous = std::set_terminate(terminate_with_context);
    g_installed.store(true);
  });
}

bool terminate_handler_installed() { return g_installed.load(); }

}  // namespace commgrad
