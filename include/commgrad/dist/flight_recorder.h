#pragma once
// The flight recorder: every process keeps its last N collectives in a ring
// buffer and writes them out (JSON, one file per rank) when a collective
// fails or times out, when the process receives SIGUSR2, or on request.
// `commgrad-trace DIR` reads the files of every rank and says which ranks
// wait in which collective, which rank is behind and which called a
// different collective (docs/flight_recorder.md).
//
// The record of a collective is the one ops already keeps for the terminate
// handler (op, group, the group's collective number): the recorder adds the
// input's dtype and sizes, a state (queued: issued, not yet on the
// transport; started: on the transport; finished; failed) and timestamps.
// N is COMMGRAD_TRACE_BUFFER_SIZE (default 2000; 0 turns the ring off, the
// terminate handler still names the collective in flight); files go to
// COMMGRAD_TRACE_DIR (commgrad-run sets a fresh one per job; default
// ./commgrad-trace).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace commgrad {

namespace detail {
struct GroupState;
}  // namespace detail

/// Writes the flight record of every rank this process runs (one file
/// `rank_<global rank>.json` each, in COMMGRAD_TRACE_DIR) and returns the
/// paths; nothing when the ring is off or holds no collective. `reason`
/// goes into the files.
///
/// Example:
///   for (const auto& path : commgrad::dump_flight_recorder("step 1000 is slow")) std::cout << path << "\n";
std::vector<std::string> dump_flight_recorder(const std::string& reason = "request");

/// The directory dumps go to: COMMGRAD_TRACE_DIR, else "commgrad-trace" in
/// the working directory.
std::string flight_recorder_directory();

/// Installs the handler of COMMGRAD_TRACE_SIGNAL (default SIGUSR2; 0 none):
/// the signal makes a helper thread write dump_flight_recorder("signal").
/// Called by init_process_group(); idempotent. A signal that already has a
/// handler is left alone.
void install_flight_recorder_signal();

namespace detail {

/// The collective in flight (issued, not finished) that this process started
/// last, for the terminate handler; `op` is null when there is none.
struct InFlight {
  const char* op = nullptr;
  uint64_t sequence = 0;
  std::weak_ptr<GroupState> group;
};

/// Records collective `op` #`sequence` on `group` with input `x` (undefined
/// for a barrier) as queued and returns its record number. Called by ops
/// for every collective, after its local checks.
uint64_t note_collective_started(const char* op, uint64_t sequence, const std::shared_ptr<GroupState>& group,
                                 const at::Tensor& x);
/// Record `record` is on the transport (its work was posted).
void note_collective_posted(uint64_t record);
/// Record `record` completed. A collective that failed is not reported
/// finished, so the terminate handler still names it.
void note_collective_finished(uint64_t record);
/// Record `record` failed (`timeout`: it did not complete in time): marks
/// it and dumps the flight record (reason `why`). A call that was not
/// recorded (point to point) only dumps.
void note_collective_failed(uint64_t record, bool timeout, const std::string& why);
/// dump_flight_recorder(reason), unless the recorder is busy (then nothing):
/// for a process that is dying.
std::vector<std::string> try_dump_flight_recorder(const std::string& reason);
/// The collective in flight, without blocking (empty when the recorder is busy).
InFlight collective_in_flight();

}  // namespace detail
}  // namespace commgrad
