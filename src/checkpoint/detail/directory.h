#pragma once
// Directory chores of save(): partial directories and pruning.

#include <cstdint>
#include <string>

namespace commgrad::checkpoint::detail {

/// ".step-00000010.partial": where step 10 is written before it is complete.
std::string partial_directory_name(int64_t step);

/// Removes the partial directories (and leftovers of a replaced step) that
/// interrupted saves left in `root`; returns how many were removed.
int remove_stale_partials(const std::string& root);

/// Before saving `step` with keep(k), k > 0: removes the oldest complete
/// steps (other than `step`) until k - 1 remain, but never the newest one,
/// so a save needs room for k steps (2 when k = 1) and a failed save still
/// leaves a step to resume from.
void prune_before_save(const std::string& root, int64_t keep, int64_t step);

/// Removes complete steps other than the newest `keep` ones (keep > 0),
/// never `current`.
void prune_steps(const std::string& root, int64_t keep, int64_t current);

/// Parses "step-00000010" (the whole name); -1 when it is not one.
int64_t parse_step_name(const std::string& name);

}  // namespace commgrad::checkpoint::detail
