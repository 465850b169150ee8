#pragma once
// How a sequence is split over a context-parallel group (commgrad::cp).
//
// Context parallelism gives each of the W ranks of a context-parallel group
// a part of every sequence, through attention too. Two layouts:
//
//   kContiguous  rank r holds tokens [r s/W, (r+1) s/W).
//   kHeadTail    the sequence is cut into 2W equal chunks and rank r holds
//                chunks r and 2W-1-r, in that order (Megatron's and
//                PyTorch's load balancing for causal attention: every rank
//                then has the same number of (query, key) pairs below the
//                diagonal). With s = 32, W = 2: rank 0 holds [0, 8) and
//                [24, 32), rank 1 holds [8, 24).
//
// Tokens, targets and positions are all split the same way, so that a
// rank's token i sits at global position local_positions(...)[i].
//
// Example:
//   auto cp_group = state.context_parallel_group();
//   auto ids = cp::shard_sequence(tokens, 1, cp::SequenceLayout::kHeadTail, cp_group);   // [b, s/W]
//   auto pos = cp::local_positions(s, cp::SequenceLayout::kHeadTail, cp_group);          // int64 [s/W]

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace commgrad::cp {

/// Which tokens of a sequence a context-parallel rank holds (see the file comment).
enum class SequenceLayout { kContiguous, kHeadTail };

/// "contiguous" or "head-tail".
const char* layout_name(SequenceLayout layout);

/// A run of consecutive global positions held by one rank: the local tokens
/// [offset, offset + length) are the global positions [position, position + length).
struct SequenceChunk {
  int64_t offset = 0;
  int64_t length = 0;
  int64_t position = 0;
};

/// The chunks rank `rank` of `size` holds of a sequence of `sequence`
/// tokens (one for kContiguous, two for kHeadTail), in local order. Errors
/// (naming `op`) when the sequence does not split into W (kContiguous) or
/// 2W (kHeadTail) equal chunks.
std::vector<SequenceChunk> sequence_chunks(int64_t sequence, SequenceLayout layout, int rank, int size,
                                           const char* op = "cp::sequence_chunks");

/// The global positions of this rank's tokens: int64 [s / W].
///
/// Example:
///   cp::local_positions(32, cp::SequenceLayout::kHeadTail, g);   // rank 0 of 2: 0..7, 24..31
at::Tensor local_positions(int64_t sequence, SequenceLayout layout, const Group& group);

/// This rank's part of `x` along `dim` (no communication; differentiable:
/// the gradient lands on this rank's tokens, zeros elsewhere). Errors, with
/// the group and the sizes, when x.size(dim) does not split (see sequence_chunks).
///
/// Example:
///   auto local = cp::shard_sequence(x, 0, cp::SequenceLayout::kHeadTail, cp_group);   // [s/W, b, h]
at::Tensor shard_sequence(const at::Tensor& x, int64_t dim, SequenceLayout layout, const Group& group);

/// The whole sequence from every rank's part (the inverse of
/// shard_sequence): an all-gather along `dim`, then the tokens put back in
/// order. backward: reduce_scatter of the gradient (Family 1, ops::all_gather).
///
/// Example:
///   auto full = cp::unshard_sequence(local_out, 2, cp::SequenceLayout::kHeadTail, cp_group);
at::Tensor unshard_sequence(const at::Tensor& local, int64_t dim, SequenceLayout layout, const Group& group);

/// For the concatenation of every rank's part in rank order (what an
/// all-gather along the sequence gives): the index of global position p in
/// it, int64 [s]. index_select(dim, gathered_order(...)) puts the tokens in order.
at::Tensor gathered_order(int64_t sequence, SequenceLayout layout, int size);

}  // namespace commgrad::cp
