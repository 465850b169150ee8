#pragma once
// Argument checks shared by the raw ops (internal to commgrad_ops). Each
// throws "[commgrad] <op> rank r/n group 'g' (<transport>): ..." before
// anything reaches the transport.

#include "call.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace commgrad::ops::detail {

/// Checks that x is defined and dense.
void check_tensor(const Call& call, const at::Tensor& x);
/// Wraps `dim` into [0, x.dim()) or throws naming the op and shape.
int64_t check_dim(const Call& call, const at::Tensor& x, int64_t dim);
/// Checks that dim `dim` of x divides by the group size.
void check_divisible(const Call& call, const at::Tensor& x, int64_t dim);
/// Checks a group rank named by an option ("src", "dst").
void check_peer(const Call& call, const char* what, int peer);
/// Checks a per-rank list: one entry per rank, none negative; with
/// `total` >= 0 they must add up to it.
void check_sizes(const Call& call, const char* what, const std::vector<int64_t>& sizes, int64_t total,
                 const at::Tensor& x, int64_t dim);

}  // namespace commgrad::ops::detail
