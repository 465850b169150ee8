#pragma once
// The process-wide terminate handler that names the collective in flight.
//
// Some transport failures cannot be caught: Gloo enforces in its I/O thread
// that a peer sends no more bytes than this rank posted, and the uncaught
// exception terminates the process. The flight recorder
// (dist/flight_recorder.h) remembers the last collective each process started (before it reaches the transport) until
// it completes, and this handler, installed by init_process_group() unless InitOptions::terminate_handler is false,
// prints it and the likely cause to stderr when one was in flight (or failed), then hands over to the handler that was
// installed before it (which prints the exception and aborts). An error thrown while no collective is in flight (a
// layer's shape error) is left to that handler alone: no collective is blamed. With the recorder on, the handler also
// writes its dump first (best effort). See docs/errors.md.

namespace commgrad {

/// Installs the handler (std::set_terminate); idempotent, thread-safe.
void install_terminate_handler();

/// True once install_terminate_handler() has run in this process.
bool terminate_handler_installed();

}  // namespace commgrad
