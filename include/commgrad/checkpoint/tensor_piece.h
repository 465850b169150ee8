#pragma once
// What a checkpoint is made of: named global tensors, each held by the ranks
// as pieces. A piece is a box (an N-d slice, e.g. this rank's tensor-
// parallel shard) of the global tensor, or a range of the row-major
// flattened box (e.g. a ZeRO optimizer's flat shard of that box).
//
//   global tensor "model/fc1.weight" [8, 4]    TP=2, rank 1's box:
//   +---------+                                box_offset [4, 0]
//   | rank 0  |  rows 0-3                      box_shape  [4, 4]
//   +---------+                                elements [0, 16) of it (all)
//   | rank 1  |  rows 4-7                      ZeRO on 2 DP ranks: [0, 8) on
//   +---------+                                one, [8, 16) on the other
//
// save() writes every piece once (identical pieces of several ranks, such as
// replicas on data-parallel ranks, are written by the lowest of them), and
// load() fills each destination piece from whatever saved pieces of the same
// name overlap it, so a checkpoint loads under any other layout.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace commgrad::checkpoint {

/// One rank's part of a named global tensor.
///
/// Example:
///   // Rank r of a TP group of 2 holds rows [4r, 4r + 4) of an [8, 4] weight:
///   checkpoint::TensorPiece piece;
///   piece.name = "model/fc1.weight";
///   piece.global_shape = {8, 4};
///   piece.box_offset = {4 * r, 0};
///   piece.box_shape = {4, 4};
///   piece.tensor = weight.detach();     // save: the data; load: written in place
///   // or, for a tensor every rank holds whole:
///   auto bias = checkpoint::TensorPiece::whole("model/fc2.bias", fc2->bias.detach());
struct TensorPiece {
  /// Global key: "model/fc1.weight", "optim/exp_avg/fc1.weight", ...
  std::string name;
  /// The unsplit tensor's shape.
  std::vector<int64_t> global_shape;
  /// Where this rank's box starts in the global tensor. Empty together with
  /// box_shape: the box is the whole tensor.
  std::vector<int64_t> box_offset;
  std::vector<int64_t> box_shape;
  /// The elements [flat_begin, flat_end) of the row-major flattened box that
  /// this piece holds; flat_end -1: up to the end of the box.
  int64_t flat_begin = 0;
  int64_t flat_end = -1;
  /// save: the data (numel == flat_end - flat_begin, any shape and strides);
  /// load: the destination, written in place (may be a non-contiguous view;
  /// its dtype must be the saved one).
  at::Tensor tensor;
  /// save: false for a copy another rank writes. Not needed for identical
  /// replicas, which save() writes once by itself.
  bool write = true;
  /// save: false marks a piece that a later load may leave out even with
  /// LoadOptions::strict() (e.g. the RNG stream of a TP rank that a smaller
  /// layout does not have). load: false lets the checkpoint lack this name;
  /// the piece is then left as it is and named in LoadResult::skipped.
  bool required = true;

  /// The tensor `tensor` views (module_pieces(): the parameter), or
  /// undefined. save() and load() check that `tensor` still shares its
  /// storage: a parameter re-pointed after its pieces were taken
  /// (ZeroOptimizer's constructor does, as Module::to() does) would
  /// otherwise be saved or loaded stale, silently.
  at::Tensor source;
  /// A piece that is the whole of a global tensor shaped like `tensor`.
  static TensorPiece whole(std::string name, at::Tensor tensor);
};

/// "'model/fc1.weight' float32 box [4:8, 0:4] of [8, 4]", plus
/// " elements [0, 8) of 16" for a flat range.
std::string describe(const TensorPiece& piece);

}  // namespace commgrad::checkpoint
