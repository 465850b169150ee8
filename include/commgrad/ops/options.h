#pragma once
// Options of the Family 1 collectives (commgrad::ops), one struct per op.
//
// Ranks named in options (src, dst) are ranks *within the group the op runs
// on* (0 .. group.size()-1), as in c10d's ProcessGroup, not global ranks; use
// Group::group_rank_of(global_rank) to convert.

#include "commgrad/ops/reduce_op.h"

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace commgrad::ops {

/// Options of all_reduce().
///
/// Example:
///   ops::all_reduce(x, ops::AllReduceOptions().op(ReduceOp::kMax));
struct AllReduceOptions {
  /// The reduction (default SUM).
  TORCH_ARG(ReduceOp, op) = ReduceOp::kSum;
};

/// Options of all_gather().
///
/// Example:
///   ops::all_gather(x, ops::AllGatherOptions().dim(-1));                 // equal sizes
///   ops::all_gather(x, ops::AllGatherOptions().dim(0).sizes({3, 1, 2}));  // rank r brings sizes[r] rows
struct AllGatherOptions {
  /// The dimension to concatenate along (negative counts from the end).
  TORCH_ARG(int64_t, dim) = 0;
  /// Size along `dim` of each rank's input, by group rank; the same list on
  /// every rank. Empty (default): every rank brings the same size.
  TORCH_ARG(std::vector<int64_t>, sizes) = {};
};

/// Options of reduce_scatter().
///
/// Example:
///   ops::reduce_scatter(x, ops::ReduceScatterOptions().dim(0).op(ReduceOp::kAvg));
///   ops::reduce_scatter(x, ops::ReduceScatterOptions().sizes({3, 1, 2}));  // rank r keeps sizes[r] rows
struct ReduceScatterOptions {
  /// The dimension to split along (negative counts from the end).
  TORCH_ARG(int64_t, dim) = 0;
  /// SUM or AVG.
  TORCH_ARG(ReduceOp, op) = ReduceOp::kSum;
  /// Size along `dim` of each rank's result, by group rank; they add up to
  /// the input's size along `dim`. Empty (default): equal parts, which needs
  /// the size along `dim` to be divisible by the group size.
  TORCH_ARG(std::vector<int64_t>, sizes) = {};
};

/// Options of broadcast().
///
/// Example:
///   ops::broadcast(x, ops::BroadcastOptions().src(1));
struct BroadcastOptions {
  /// Group rank whose tensor is copied to every rank.
  TORCH_ARG(int, src) = 0;
};

/// Options of reduce().
///
/// Example:
///   ops::reduce(x, ops::ReduceOptions().dst(0).op(ReduceOp::kAvg));
struct ReduceOptions {
  /// Group rank that receives the reduction.
  TORCH_ARG(int, dst) = 0;
  /// The reduction; SUM and AVG are differentiable, the others forward only.
  TORCH_ARG(ReduceOp, op) = ReduceOp::kSum;
};

/// Options of scatter().
///
/// Example:
///   ops::scatter(x, ops::ScatterOptions().src(0).dim(1));
struct ScatterOptions {
  /// Group rank whose tensor is split.
  TORCH_ARG(int, src) = 0;
  /// The dimension to split along (divisible by the group size).
  TORCH_ARG(int64_t, dim) = 0;
};

/// Options of gather().
///
/// Example:
///   ops::gather(x, ops::GatherOptions().dst(0).dim(0));
struct GatherOptions {
  /// Group rank that receives the concatenation.
  TORCH_ARG(int, dst) = 0;
  /// The dimension to concatenate along.
  TORCH_ARG(int64_t, dim) = 0;
};

/// Options of all_to_all().
///
/// Rank r splits its input along `dim` into group.size() parts and sends part
/// s to rank s; the result is the parts received from ranks 0, 1, ...,
/// concatenated along `dim`.
///
/// Example:
///   ops::all_to_all(x);                                   // equal parts
///   ops::all_to_all(x, ops::AllToAllOptions()             // expert parallelism:
///                          .input_splits({2, 0, 3})       //   rows sent to ranks 0, 1, 2
///                          .output_splits({1, 1, 4}));    //   rows received from ranks 0, 1, 2
struct AllToAllOptions {
  /// The dimension to split and concatenate along.
  TORCH_ARG(int64_t, dim) = 0;
  /// Size along `dim` of the part sent to each rank. Empty: equal parts.
  TORCH_ARG(std::vector<int64_t>, input_splits) = {};
  /// Size along `dim` of the part received from each rank. Empty with
  /// input_splits given: exchanged first (one more small all_to_all).
  /// Empty without input_splits: equal parts.
  TORCH_ARG(std::vector<int64_t>, output_splits) = {};
};

/// Options of send().
///
/// Example:
///   auto token = ops::send(x, ops::SendOptions(1));
struct SendOptions {
  /* implicit */ SendOptions(int dst) : dst_(dst) {}
  /// Group rank to send to.
  TORCH_ARG(int, dst);
  /// Matches a recv() with the same tag.
  TORCH_ARG(int, tag) = 0;
};

/// Options of recv().
///
/// Example:
///   auto y = ops::recv({4, 8}, ops::RecvOptions(0).dtype(at::kFloat).requires_grad(true));
struct RecvOptions {
  /* implicit */ RecvOptions(int src) : src_(src) {}
  /// Group rank to receive from.
  TORCH_ARG(int, src);
  /// Matches a send() with the same tag.
  TORCH_ARG(int, tag) = 0;
  /// Element type of the tensor being received.
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
  /// True when the sender's tensor requires grad: the received tensor then
  /// requires grad and its gradient is sent back to the sender by backward().
  TORCH_ARG(bool, requires_grad) = false;
};

}  // namespace commgrad::ops
