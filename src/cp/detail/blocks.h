#pragma once
// The block arithmetic of context-parallel attention (blocks.cpp): one block
// of queries against one block of keys, forward with its log-sum-exp and
// backward from the final log-sum-exp (FlashAttention's recurrences), the
// merge of partial outputs, and which blocks a causal mask hides.

#include "commgrad/cp/sequence.h"

#include <ATen/core/Tensor.h>

namespace commgrad::cp::detail {

/// What a chunk of queries sees of a chunk of keys.
enum class Visibility { kNone, kAll, kMasked };

/// kAll without a causal mask; with one, kAll when every key precedes every
/// query, kNone when every key follows every query, else kMasked.
Visibility visibility(const SequenceChunk& q, const SequenceChunk& k, bool causal);

/// bool [q.length, k.length]: true where the key's position <= the query's.
at::Tensor causal_mask(const SequenceChunk& q, const SequenceChunk& k);

/// A block's output (normalised over its own keys) and log-sum-exp
/// [b, h, lq] of its scaled scores (-inf for a query that sees no key).
struct BlockResult {
  at::Tensor out, lse;
};

/// q [b, h, lq, d], k, v [b, h, lk, d] (one dtype), `allowed` bool [lq, lk]
/// or undefined (all allowed).
BlockResult block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                          double scale);

/// Adds a block to the running (out, lse) of the same queries: both
/// rescaled to the new log-sum-exp. out, lse undefined: the block itself.
void merge(at::Tensor& out, at::Tensor& lse, const BlockResult& block);

struct BlockGrads {
  at::Tensor dq, dk, dv;
};

/// The block's share of dq, dk, dv from the final log-sum-exp `lse` [b, h, lq]
/// and delta = rowsum(dout * out) [b, h, lq].
BlockGrads block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                          const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& allowed, double scale);

/// The dtype the blocks compute and merge in: float32 for 16-bit inputs,
/// the input's dtype otherwise.
at::ScalarType accumulate_dtype(at::ScalarType dtype);

}  // namespace commgrad::cp::detail
