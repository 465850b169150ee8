#pragma once
// What a rank says when it dies of an uncaught error: one message, without
// LibTorch's backtrace unless COMMGRAD_BACKTRACE=1, and where a launcher can
// find it. Under commgrad-run or torchrun (TORCHELASTIC_ERROR_FILE set per
// rank) the error goes to that file in torchrun's JSON form and the launcher
// prints each distinct error of the job once; without a launcher it goes to
// stderr as one line "[commgrad] rank R: <type>: <message>" (RANK, when set).
//
// The terminate handler (dist/terminate_handler.h) calls report_uncaught_error
// for an exception nobody caught; a program that catches errors in main() can
// call it too and return 1, as Python's @record does.

#include <exception>
#include <string>

namespace commgrad {

/// The type and message of `error`, without a backtrace:
/// "commgrad::InvalidArgumentError: [commgrad] all_gather rank 0/2 ...".
std::string describe_error(const std::exception_ptr& error);

/// Reports `error` as a rank's last word: into TORCHELASTIC_ERROR_FILE when
/// it is set, else to stderr; `context` (a line about the collective in
/// flight, say) goes with it. Never throws.
///
/// Example:
///   int main() {
///     try { train(); } catch (...) { commgrad::report_uncaught_error(std::current_exception()); return 1; }
///   }
void report_uncaught_error(const std::exception_ptr& error, const std::string& context = "");

}  // namespace commgrad
