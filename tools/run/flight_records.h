#pragma once

// The flight records of a job (docs/flight_recorder.md): commgrad-run gives
// its ranks a directory to dump them in, and when the job failed and ranks
// dumped, runs `commgrad-trace DIR` to print the diagnosis.

#include <functional>
#include <string>

namespace commgrad::run {

/// Where the ranks of a job write their flight records.
struct FlightRecords {
  /// COMMGRAD_TRACE_DIR of the launcher's environment when set, else a new
  /// name under TMPDIR (the ranks make the directory when they first write).
  std::string dir;
  /// True when the launcher named `dir` (and removes it when it is empty).
  bool created = false;
};

/// Picks the directory.
FlightRecords prepare_flight_records();

/// After the job: when it failed and ranks wrote records, says where and
/// prints commgrad-trace's diagnosis through `report` (one line each); when
/// it succeeded, says where records are if ranks wrote any on request. Removes
/// a directory of the launcher's own that stayed empty.
void finish_flight_records(const FlightRecords& records, bool failed,
                           const std::function<void(const std::string&)>& report);

}  // namespace commgrad::run
