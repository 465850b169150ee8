#pragma once
// The process-wide terminate handler that names the collective in flight.
//
// Some transport failures cannot be caught: Gloo enforces in its I/O thread
// that a peer sends no more bytes than this rank posted, and the uncaught
// exception terminates the process. commgrad remembers the last collective
// each process started (before it reaches the transport) until it completes.
// This handler, installed by init_process_group() unless
// InitOptions::terminate_handler is false, reports the error once, without
// LibTorch's backtrace unless COMMGRAD_BACKTRACE=1 (dist/uncaught_error.h:
// into the launcher's error file, or to stderr), with a line naming the
// collective when one was in flight (or failed), and exits with status 1. An
// error thrown while no collective is in flight (a layer's shape error)
// blames no collective. A terminate handler the program installed before
// runs instead of the exit. See docs/errors.md.

#include <cstdint>
#include <memory>

namespace commgrad {

namespace detail {
struct GroupState;
}  // namespace detail

/// Installs the handler (std::set_terminate); idempotent, thread-safe.
void install_terminate_handler();

/// True once install_terminate_handler() has run in this process.
bool terminate_handler_installed();

namespace detail {
/// Records the collective `op` #`sequence` on `group` as the last one this
/// process started (the handler names it). Called by ops for every collective.
void note_collective_started(const char* op, uint64_t sequence, const std::shared_ptr<GroupState>& group);
/// Records that collective #`sequence` on `group` completed: if it is the
/// one last started, the handler no longer names it. A collective that
/// failed is not reported finished, so the handler still names it.
void note_collective_finished(uint64_t sequence, const std::shared_ptr<GroupState>& group);
}  // namespace detail

}  // namespace commgrad
