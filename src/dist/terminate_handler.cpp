// The terminate handler that names the collective in flight (see the header).

#include "commgrad/dist/terminate_handler.h"

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

// The last collective this process started, until it completes: the
// handler names it only while it is in flight (or after it failed), never for
// an error that has nothing to do with communication (a layer's shape error
// thrown after the last collective finished).
struct Started {
  const char* op = nullptr;
  uint64_t sequence = 0;
  const void* group_id = nullptr;           // identity of the group, for note_collective_finished
  std::weak_ptr<detail::GroupState> group;  // not kept alive by this record
};
std::mutex g_started_mutex;
Started g_started;
std::terminate_handler g_previous = nullptr;
std::atomic<bool> g_installed{false};

// The line that names the collective in flight, when one was: the error
// may be about it (Gloo aborts in its I/O thread), or have cut it short.
std::string collective_in_flight(const std::string& what) {
  Started last;
  if (g_started_mutex.try_lock()) {  // never block a dying process
    last = g_started;
    g_started_mutex.unlock();
  }
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
  return line;
}

// Reports an exception nobody could catch (in a transport's I/O thread, or
// one the program let through main) once, without LibTorch's backtrace
// unless asked (dist/uncaught_error.h), naming the collective in flight if
// any. Then the process exits with status 1, as a Python rank does; a
// handler the program installed before init_process_group runs instead.
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

namespace detail {

void note_collective_started(const char* op, uint64_t sequence, const std::shared_ptr<GroupState>& group) {
  std::lock_guard<std::mutex> lock(g_started_mutex);
  g_started.op = op;
  g_started.sequence = sequence;
  g_started.group_id = group.get();
  g_started.group = group;
}

void note_collective_finished(uint64_t sequence, const std::shared_ptr<GroupState>& group) {
  std::lock_guard<std::mutex> lock(g_started_mutex);
  if (g_started.op != nullptr && g_started.sequence == sequence && g_started.group_id == group.get()) {
    g_started = Started();
  }
}

}  // namespace detail
}  // namespace commgrad
