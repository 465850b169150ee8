#pragma once
// Family 1 differentiable collectives: the objective is the sum of every
// rank's own loss, L = sum_r L_r (torch.distributed.nn.functional, data
// parallelism; see docs/design.md "Gradient semantics"). Each op takes a tensor,
// its options and a group (empty: the world), returns a NEW tensor (its input
// is never modified), and is one autograd Function whose backward is stated
// on its declaration.
//
// Every member of the group calls the same ops in the same order, and every
// rank whose result needs a gradient runs backward() (the backward passes are
// collectives too). Ranks in options are group ranks.
//
// Backward overlaps: an op's backward node only starts its gradient
// collective; a node named commgrad::WaitForGradient between it and the
// op's input waits for it, and the autograd engine runs it only when no
// other backward work is ready. So the gradient collectives of one part of
// a model run while backward computes the rest (other branches, weight
// gradients, earlier collectives' local steps). A gradient collective that
// finishes on the call anyway (shm below its async_bytes, a group of one)
// is waited for on the spot: there is nothing to overlap, and the second
// node would cost more than the collective.
//
// Example:
//   auto world = commgrad::init_process_group();
//   auto x = torch::ones({4}, torch::requires_grad());
//   auto y = commgrad::ops::all_reduce(x);          // [n, n, n, n]
//   y.sum().backward();                              // x.grad = [n, n, n, n]

#include "commgrad/dist/group.h"
#include "commgrad/ops/options.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace commgrad::ops {

/// y = reduction of every rank's x, on every rank (replicated: bitwise equal).
/// backward: SUM -> all_reduce SUM of grads; AVG -> all_reduce AVG of grads;
/// MAX/MIN -> all_reduce SUM of grads, routed to the ranks holding the
/// extremum, split evenly between ties; PRODUCT -> error.
at::Tensor all_reduce(const at::Tensor& x, const AllReduceOptions& options = {}, const Group& group = Group());

/// y = concatenation of every rank's x along dim (replicated).
/// backward: reduce_scatter SUM of grads along dim (with the same sizes).
///
/// Example:
///   auto full = ops::all_gather(shard, ops::AllGatherOptions().dim(-1), tp_group);
at::Tensor all_gather(const at::Tensor& x, const AllGatherOptions& options = {}, const Group& group = Group());

/// y = this rank's part along dim of the SUM (or AVG) of every rank's x.
/// backward: all_gather of grads along dim (scaled by 1/n for AVG).
///
/// Example:
///   auto part = ops::reduce_scatter(x, ops::ReduceScatterOptions().dim(0));
at::Tensor reduce_scatter(const at::Tensor& x, const ReduceScatterOptions& options = {}, const Group& group = Group());

/// y = src's x on every rank (the others' x give only shape and dtype).
/// backward: reduce SUM of grads to src; the other ranks' x get zero grads.
///
/// Example:
///   auto w0 = ops::broadcast(w, ops::BroadcastOptions().src(0));
at::Tensor broadcast(const at::Tensor& x, const BroadcastOptions& options = {}, const Group& group = Group());

/// y = reduction of every rank's x on dst; zeros (a constant) on the others.
/// backward: broadcast of dst's grad from dst (scaled by 1/n for AVG);
/// MAX/MIN/PRODUCT -> error.
///
/// Example:
///   auto total = ops::reduce(loss, ops::ReduceOptions().dst(0));
at::Tensor reduce(const at::Tensor& x, const ReduceOptions& options = {}, const Group& group = Group());

/// y = part r along dim of src's x on rank r (the others' x give only shape
/// and dtype; the size along dim must divide by the group size).
/// backward: gather of grads to src; the other ranks' x get zero grads.
///
/// Example:
///   auto mine = ops::scatter(batch, ops::ScatterOptions().src(0).dim(0));
at::Tensor scatter(const at::Tensor& x, const ScatterOptions& options = {}, const Group& group = Group());

/// y = concatenation along dim of every rank's x on dst (equal sizes);
/// zeros of that shape (a constant) on the others.
/// backward: scatter of dst's grad from dst.
///
/// Example:
///   auto all = ops::gather(part, ops::GatherOptions().dst(0));
at::Tensor gather(const at::Tensor& x, const GatherOptions& options = {}, const Group& group = Group());

/// y = the parts of every rank's x addressed to this rank, concatenated along dim.
/// backward: all_to_all of grads with input and output splits swapped.
///
/// Example:
///   auto tokens = ops::all_to_all(x, ops::AllToAllOptions().input_splits(send).output_splits(recv));
at::Tensor all_to_all(const at::Tensor& x, const AllToAllOptions& options = {}, const Group& group = Group());

/// Sends x to options.dst() and returns a scalar zero "token" that depends on
/// x: when x requires grad, token.backward() (or adding the token to the
/// loss) receives x's gradient from the receiver.
/// backward: recv of the gradient from dst.
///
/// Example:
///   auto token = ops::send(activations, ops::SendOptions(next_stage));
///   token.backward();  // after the next stage ran its backward
at::Tensor send(const at::Tensor& x, const SendOptions& options, const Group& group = Group());

/// Receives a tensor of `sizes` from options.src(); with
/// options.requires_grad() the result requires grad and its gradient travels
/// back to the sender during backward().
/// backward: send of the gradient to src.
///
/// Example:
///   auto x = ops::recv({8, 16}, ops::RecvOptions(prev_stage).requires_grad(true));
at::Tensor recv(at::IntArrayRef sizes, const RecvOptions& options, const Group& group = Group());

/// Returns when every member of the group has called barrier().
///
/// Example:
///   ops::barrier(group);
void barrier(const Group& group = Group());

}  // namespace commgrad::ops
