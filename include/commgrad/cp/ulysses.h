#pragma once
// DeepSpeed Ulysses' all-to-alls (commgrad::cp): from sequence parts to head
// parts and back, over a context-parallel group of W ranks.
//
// x is [batch, heads, tokens, head_dim]. sequence_to_heads takes this rank's
// s/W tokens of every head to all s tokens of heads [r H/W, (r+1) H/W); the
// tokens come in rank order (rank 0's part first), which under the
// head-tail layout is not position order (sequence.h: gathered_order).
// heads_to_sequence is its inverse. Each is one ops::all_to_all, whose
// backward is the all-to-all with the splits transposed, i.e. the other function.
//
// Example:
//   auto xh = cp::sequence_to_heads(x, cp_group);    // [b, H/W, s, d]
//   auto x2 = cp::heads_to_sequence(xh, cp_group);   // == x

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>

namespace commgrad::cp {

/// [b, H, s/W, d] (this rank's tokens, every head) -> [b, H/W, s, d] (every
/// token, this rank's heads). Errors, with the group and the sizes, when H
/// is not divisible by W. backward: heads_to_sequence of the gradient.
///
/// Example:
///   auto qh = cp::sequence_to_heads(q, cp_group);
at::Tensor sequence_to_heads(const at::Tensor& x, const Group& group);

/// [b, H/W, s, d] -> [b, H, s/W, d]: the inverse of sequence_to_heads.
/// backward: sequence_to_heads of the gradient.
///
/// Example:
///   auto out = cp::heads_to_sequence(out_heads, cp_group);
at::Tensor heads_to_sequence(const at::Tensor& x, const Group& group);

}  // namespace commgrad::cp
