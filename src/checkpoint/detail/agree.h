#pragma once
// How the ranks of a save or load agree, so that a failure on one rank never
// leaves the others waiting in a collective: every phase ends in one
// exchange of a short status string, and then all ranks either go on or all
// throw.

#include "commgrad/dist/group.h"

#include <functional>
#include <string>
#include <vector>

namespace commgrad::checkpoint::detail {

/// Every rank's `mine`, by group rank (two ops::raw::all_gathers: the
/// lengths, then the padded bytes).
std::vector<std::string> exchange_strings(const std::string& mine, const Group& group);

/// Runs `phase`, catching a c10::Error it throws, then exchanges each rank's
/// outcome. When every rank succeeded, returns every rank's payload (what
/// `phase` returned). Otherwise throws on every rank: the failing rank its
/// own error, prefixed "[commgrad] <op> rank r/n group 'g' (transport): ",
/// the others "... rank 2 failed: <that rank's error>".
std::vector<std::string> run_phase(const char* op, const Group& group, const std::function<std::string()>& phase);

}  // namespace commgrad::checkpoint::detail
