#pragma once
// A run-time check, under COMMGRAD_DEBUG, that the parameters every rank of a
// tensor-parallel group holds whole (replicated: biases of row-parallel
// layers, norms, sequence-parallel norms) are still equal on every rank of
// it. They drift apart silently when one TP rank steps with another gradient
// or another clipping factor (a norm taken without the TP group, a gradient
// summed on one rank only); the check turns that into an error at the step
// where it first happens, naming the parameter and the ranks.
//
// Cost: one all_gather over the TP group of two 64-bit checksums per
// replicated parameter, and a pass over those parameters' bytes. DDP runs it
// before each forward and ZeroOptimizer after each step when the debug check
// is on (ops::debug_checks()); off, they do nothing.

#include "commgrad/dist/group.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace commgrad::tp {

/// Errors (a MismatchError naming `op`, the first parameter that differs and
/// two ranks that disagree) unless every parameter of `module` that is
/// replicated over the tensor-parallel group its partitioned parameters are
/// split over is bit for bit equal on every rank of that group. Collective
/// over that group; does nothing when the module holds no partitioned
/// parameter (no TP group). Runs whether or not the debug check is on.
///
/// Example:
///   tp::check_replicated_parameters(*model, "my_trainer");
void check_replicated_parameters(const torch::nn::Module& module, const char* op);

/// check_replicated_parameters when ops::debug_checks() is on.
void debug_check_replicated_parameters(const torch::nn::Module& module, const char* op);

}  // namespace commgrad::tp
