#pragma once
// Family 2 region mappings: Megatron's tensor-parallel communication
// vocabulary (mappings.py), as differentiable functions.
//
// Family 2 ("one replicated loss", docs/design.md): every rank of a tensor-
// parallel group holds identical copies of the replicated activations and
// computes the same loss L; the objective is L, not n * L. So a gradient that
// is already identical on every rank is NOT summed again: the backward of an
// all-reduce is the identity, and the backward of copying a replicated tensor
// into a split region is the all-reduce. These are different ops from the
// Family 1 collectives in commgrad::ops (whose objective is the sum of every
// rank's own loss); using one where the other belongs scales gradients by the
// TP size (tests/tp/semantics_test.cpp shows it).
//
//   mapping                                      forward              backward
//   copy_to_tp_region ("f")                      identity             all_reduce SUM
//   reduce_from_tp_region ("g")                  all_reduce SUM       identity
//   scatter_to_tp_region                         own chunk, last dim  all_gather last dim
//   gather_from_tp_region                        all_gather last dim  own chunk, last dim
//   scatter_to_sequence_parallel_region          own chunk, dim 0     all_gather dim 0
//   gather_from_sequence_parallel_region         all_gather dim 0     reduce_scatter dim 0
//   reduce_scatter_to_sequence_parallel_region   reduce_scatter dim 0 all_gather dim 0
//
// Each takes the tensor-parallel group (empty: the current parallel state's,
// see parallel_state.h), never modifies its input, accepts non-contiguous
// inputs, and checks divisibility before any communication. On a group of
// one rank every mapping is the identity (after the same checks).

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>

namespace commgrad::tp {

/// forward: identity (a view of x); backward: all_reduce SUM of the gradient.
/// Megatron's "f": enters a column-parallel region with a replicated input.
///
/// Example:
///   auto y = torch::matmul(tp::copy_to_tp_region(x, tp_group), w_shard.t());
at::Tensor copy_to_tp_region(const at::Tensor& x, const Group& group = Group());

/// forward: all_reduce SUM; backward: identity.
/// Megatron's "g": leaves a row-parallel region with partial sums.
///
/// Example:
///   auto y = tp::reduce_from_tp_region(torch::matmul(x_shard, w_shard.t()), tp_group);
at::Tensor reduce_from_tp_region(const at::Tensor& x, const Group& group = Group());

/// forward: this rank's chunk of the last dim; backward: all_gather along the last dim.
///
/// Example:
///   auto x_shard = tp::scatter_to_tp_region(x, tp_group);   // [.., h] -> [.., h/n]
at::Tensor scatter_to_tp_region(const at::Tensor& x, const Group& group = Group());

/// forward: all_gather along the last dim; backward: this rank's chunk of the last dim.
///
/// Example:
///   auto full = tp::gather_from_tp_region(y_shard, tp_group);   // [.., h/n] -> [.., h]
at::Tensor gather_from_tp_region(const at::Tensor& x, const Group& group = Group());

/// forward: this rank's chunk of dim 0 (the sequence); backward: all_gather along dim 0.
///
/// Example:
///   auto chunk = tp::scatter_to_sequence_parallel_region(x, tp_group);   // [s, b, h] -> [s/n, b, h]
at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, const Group& group = Group());

/// forward: all_gather along dim 0; backward: reduce_scatter SUM along dim 0.
///
/// Example:
///   auto seq = tp::gather_from_sequence_parallel_region(chunk, tp_group);   // [s/n, ..] -> [s, ..]
at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, const Group& group = Group());

/// forward: reduce_scatter SUM along dim 0; backward: all_gather along dim 0.
///
/// Example:
///   auto chunk = tp::reduce_scatter_to_sequence_parallel_region(partial, tp_group);   // [s, ..] -> [s/n, ..]
at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, const Group& group = Group());

namespace detail {

/// forward: this rank's chunk of `dim`; backward: all_gather along `dim`.
/// (scatter_to_tp_region and scatter_to_sequence_parallel_region for any dim;
/// the gradient checker splits inputs with it.)
at::Tensor split_along(const at::Tensor& x, int64_t dim, const Group& group, const char* op);

/// forward: all_gather along `dim`; backward: this rank's chunk of `dim`.
/// (gather_from_tp_region for any dim; the gradient checker gathers outputs with it.)
at::Tensor gather_along(const at::Tensor& x, int64_t dim, const Group& group, const char* op);

}  // namespace detail
}  // namespace commgrad::tp
