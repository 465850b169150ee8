#pragma once
// The cross-rank debug check of commgrad::ops.
//
// With the check on, every collective first exchanges a fingerprint of the
// call (op, sequence number, shapes, dtypes, options) with the other members
// of its group, and every rank raises the same error, showing both sides,
// when they disagree, instead of running a mismatched collective (which
// ends with a transport error or a timeout). Point-to-point send/recv send a
// small header ahead of the data for the same purpose. It costs one small
// all_gather per collective.
//
// On when COMMGRAD_DEBUG is 1, CHECK or TRACE (on every rank: a rank with the
// check and one without cannot talk), or after set_debug_checks(true).

#include <optional>

namespace commgrad::ops {

/// True when collectives check their fingerprint across ranks.
bool debug_checks();

/// Turns the check on or off for the whole process; std::nullopt goes back
/// to what COMMGRAD_DEBUG says. Every rank must make the same choice.
///
/// Example:
///   commgrad::ops::set_debug_checks(true);
void set_debug_checks(std::optional<bool> enabled);

}  // namespace commgrad::ops
