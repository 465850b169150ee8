#pragma once

// The diagnosis of a job's flight records: for every group whose ranks did
// not all finish their collectives, the first collective that is not
// finished everywhere (its number in the group), which ranks are in it,
// which never called it (and where they are instead), which called a
// different collective at that number; then the verdict: the ranks that
// differ from the rest.
//
// Example (rank 1 skipped an all_reduce and went on to another group):
//   group 'world' (ranks [0, 1, 2]) is stuck at collective #1:
//     ranks [0, 2] are in all_reduce #1 float32[8] (timed_out, 3.0 s after it was issued)
//     rank 1 never called #1 (its last there: all_reduce #0 float32[8], finished); it is in
//       all_reduce #1 float32[1] on group 'metrics' (timed_out)
//   ...
//   diagnosis:
//     rank 1 is behind on group 'world': ranks [0, 2] wait in all_reduce #1 float32[8], which rank 1
//       never called; rank 1 is in all_reduce #1 float32[1] on group 'metrics'

#include "dumps.h"

#include <string>
#include <vector>

namespace commgrad::trace {

/// The report's lines, without line ends.
std::vector<std::string> diagnose(const std::vector<Dump>& dumps);

}  // namespace commgrad::trace
