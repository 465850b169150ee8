#pragma once
// The process-wide terminate handler that names the collective in flight.
//
// Some transport failures cannot be caught: Gloo enforces in its I/O thread
// that a peer sends no more bytes than this rank posted, and the uncaught
// exception terminates the process. The flight recorder
// (dist/flight_recorder.h) remembers the last collective each process
// started (before it reaches the transport) until it completes. This
// handler, installed by init_process_group() unless
// InitOptions::terminate_handler is false, reports the error once, without
// LibTorch's backtrace unless COMMGRAD_BACKTRACE=1 (dist/uncaught_error.h:
// into the launcher's error file, or to stderr), with a line naming the
// collective when one was in flight (or failed), after writing the flight
// record then (best effort), and exits with status 1. An error thrown while
// no collective is in flight (a layer's shape error) blames no collective.
// A terminate handler the program installed before runs instead of the exit.
// See docs/errors.md.

namespace commgrad {

/// Installs the handler (std::set_terminate); idempotent, thread-safe.
void install_terminate_handler();

/// True once install_terminate_handler() has run in this process.
bool terminate_handler_installed();

}  // namespace commgrad
