#pragma once

// The flight-recorder dumps of a job (src/dist/flight_recorder.cpp writes
// them, one JSON file per rank), read back for commgrad-trace.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::trace {

/// One recorded collective of one rank.
struct Entry {
  uint64_t record = 0;
  std::string op;          // "all_reduce", "barrier", ...
  std::string group;       // the group's name
  std::vector<int> ranks;  // the group's members (world ranks); empty when it was destroyed
  uint64_t seq = 0;        // the collective's number in its group
  std::string dtype;       // empty for a barrier
  std::vector<int64_t> sizes;
  std::string state;  // queued, started, finished, failed, timed_out
  int64_t queued_us = 0;
  std::optional<int64_t> finished_us;

  bool finished() const { return state == "finished"; }
  /// "all_reduce #3 float32[8]".
  std::string describe() const;
  /// What must agree across ranks: op, dtype and sizes.
  std::string signature() const;
  /// The group's identity across dumps: name and members.
  std::string group_key() const;
};

/// One rank's dump.
struct Dump {
  int rank = -1;
  std::string path;
  std::string reason;
  std::string host;
  int64_t dumped_us = 0;
  std::vector<Entry> entries;  // oldest first
};

/// Reads every rank_<r>.json in `dir`, sorted by rank. Files that cannot be
/// read or parsed are skipped, each with a line in `problems`.
std::vector<Dump> read_dumps(const std::string& dir, std::vector<std::string>& problems);

/// "[0, 2]".
std::string format_ranks(const std::vector<int>& ranks);

}  // namespace commgrad::trace
