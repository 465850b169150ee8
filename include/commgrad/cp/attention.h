#pragma once
// Attention over a context-parallel group: every rank holds a part of the
// sequence (sequence.h) of q, k and v, and gets the attention output of its
// own queries over the keys of the whole sequence (commgrad::cp).
//
// Three ways, with the same result (docs/context_parallel.md says when each pays):
//
//   kAllGather  K and V are all-gathered (one collective of 2 (W-1)/W s b h
//               elements per rank), each rank attends its queries to the
//               keys they see. backward: reduce_scatter of dK, dV. Memory:
//               the whole K, V and the scores [s/W, s].
//   kRing       K and V travel around the ring of W ranks, W-1 transfers of
//               one part each, the next one in flight while the current
//               block computes; partial outputs are merged by their
//               log-sum-exp in float32 (at least); blocks that the causal
//               mask hides are skipped. backward: K, V travel the ring again
//               (W-1 transfers) with the dK, dV accumulators behind them (W
//               transfers: the last brings each home). Memory: two parts of
//               K, V and one block of scores.
//   kUlysses    all-to-all from sequence parts to head parts (every rank:
//               all tokens, heads/W heads), ordinary attention, all-to-all
//               back (DeepSpeed Ulysses). backward: the all-to-alls with the
//               splits transposed. Needs heads divisible by W.
//
// The gradient semantics are Family 2 (docs/design.md): one loss over the
// tokens of the whole sequence, each rank's gradients of its own q, k, v.
//
// Example:
//   auto out = cp::attention(q, k, v, cp::ContextParallelOptions(cp_group, cp::AttentionMode::kRing));
//   // q, k, v, out: [batch, heads, s/W, head_dim]

#include "commgrad/cp/sequence.h"
#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>

namespace commgrad::cp {

/// How attention crosses the context-parallel group (see the file comment).
enum class AttentionMode { kAllGather, kRing, kUlysses };

/// "allgather", "ring" or "ulysses".
const char* mode_name(AttentionMode mode);
/// The mode named "allgather", "ring" or "ulysses"; errors on another name.
AttentionMode parse_mode(const std::string& name);

/// What the ring moved (each transfer one message to the next rank). For W
/// ranks one forward makes W-1 K/V transfers, one backward W-1 K/V
/// transfers and W dK/dV transfers (none when W = 1).
struct RingCounters {
  int64_t forward_kv = 0;
  int64_t backward_kv = 0;
  int64_t backward_dkv = 0;
  /// Bytes this rank sent, forward and backward.
  int64_t bytes_sent = 0;
};

/// Options of cp::attention.
///
/// Example:
///   cp::ContextParallelOptions(cp_group, cp::AttentionMode::kAllGather).causal(false)
struct ContextParallelOptions {
  /* implicit */ ContextParallelOptions(Group group = Group(), AttentionMode mode = AttentionMode::kRing)
      : group_(std::move(group)), mode_(mode) {}
  /// The context-parallel group (a group of one: plain attention).
  TORCH_ARG(Group, group);
  TORCH_ARG(AttentionMode, mode);
  /// Which tokens each rank holds (the same for q, k and v).
  TORCH_ARG(SequenceLayout, layout) = SequenceLayout::kHeadTail;
  /// A query sees the keys at its global position and before.
  TORCH_ARG(bool, causal) = true;
  /// When set, the ring adds what it moved here (tests and benchmarks).
  TORCH_ARG(std::shared_ptr<RingCounters>, counters) = nullptr;
};

/// softmax(q k^T / sqrt(d) + mask) v for this rank's queries over the whole
/// sequence's keys: q, k, v [batch, heads, s/W, head_dim] (this rank's
/// tokens, in options.layout()) -> [batch, heads, s/W, head_dim].
/// backward: per mode (file comment); dq, dk, dv of this rank's tokens.
/// Errors (with the group and the sizes) on shapes that differ, a sequence
/// that does not split under the layout, heads not divisible by W under
/// kUlysses.
///
/// Example:
///   auto out = cp::attention(q, k, v, cp::ContextParallelOptions(g, cp::AttentionMode::kUlysses));
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const ContextParallelOptions& options);

/// The same attention on one rank over the whole sequence (what a group of
/// one runs): q, k, v [batch, heads, s, head_dim]. Under a causal mask the
/// queries go in 4 chunks, each over the keys up to its end, so the blocks
/// above the diagonal are not computed.
at::Tensor full_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal);

}  // namespace commgrad::cp
