// The terminate handler that names the collective in flight (see the header).

#include "commgrad/dist/terminate_handler.h"

#include "commgrad/dist/flight_recorder.h"
#include "commgrad/dist/group.h"
#include "commgrad/dist/uncaught_error.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <mutex>
#include <string>

namespace commgrad {
namespace {

std::terminate_handler g_previous = nullptr;
std::atomic<bool> g_installed{false};

// The line that names the collective in flight, when one was: the error
// may be about it (Gloo aborts in its I/O thread), or have cut it short.
// Only then: an error that has nothing to do with communication (a layer's
// shape error thrown after the last collective finished) blames none.
std::string collective_in_flight(const std::string& what) {
  const detail::InFlight last = detail::collective_in_flight();
  if (last.op == nullptr) return "";
  const auto state = last.group.lock();
  std::string line = std::string("[commgrad] ") + last.op + " " +
                     (state ? Group(state).describe() : std::string("(group gone)")) +
                     ": the process is terminating (" + what + ") while collective #" + std::to_string(last.sequence) +
                     " had not completed";
  if (what.find("op.preamble.length <= op.nbytes") != std::string::npos) {
    line +=
        ". Gloo aborts like this when another rank called a collective with more data than this rank; set "
        "COMMGRAD_DEBUG=1 on every rank to check each collective across ranks and raise an error on all of them "
        "instead";
  }
  for (const auto& path : detail::try_dump_flight_recorder("terminate: " + what)) {
    line += "\n[commgrad] flight record written to " + path;
  }
  return line;
}

// Reports an exception nobody could catch (in a transport's I/O thread, or
// one the program let through main) once, without LibTorch's backtrace
// unless asked (dist/uncaught_error.h), naming the collective in flight if
// any (and writing the flight record then). Then the process exits with
// status 1, as a Python rank does; a handler the program installed before
// init_process_group runs instead.
[[noreturn]] void terminate_with_context() {
  const auto error = std::current_exception();
  report_uncaught_error(error, collective_in_flight(describe_error(error)));
  std::fflush(nullptr);
  if (g_previous != nullptr && g_previous != __gnu_cxx::__verbose_terminate_handler) g_previous();
  std::_Exit(1);
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
