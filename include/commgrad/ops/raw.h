#pragma once
// The raw (non-autograd) collectives under commgrad::ops: tensor in, tensor
// out, with every check, the debug-mode fingerprint and the transport
// workarounds (AVG on Gloo, reduce_scatter from alltoall, uneven sizes,
// bfloat16), but no autograd graph. The differentiable ops, tensor
// parallelism and DDP are built on these, so no layer reimplements them.
//
// Each call validates its arguments locally, then starts the collective and
// returns a Pending at once; Pending::wait() finishes it (runs any local
// post-processing) and returns the result. Like the differentiable ops they
// never modify their input, except all_reduce_ which works in place.
//
// Every member of the group must call the same raw ops in the same order.

#include "commgrad/dist/group.h"
#include "commgrad/ops/options.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <memory>

namespace commgrad::ops {

namespace detail {
struct PendingState;  // src/ops/pending.cpp
}  // namespace detail

namespace raw {

/// An in-flight collective started by a raw op.
///
/// Example:
///   auto pending = ops::raw::all_reduce(bucket, {}, group);
///   ... compute ...
///   at::Tensor reduced = pending.wait();
class Pending {
 public:
  Pending() = default;
  explicit Pending(std::shared_ptr<detail::PendingState> state) : state_(std::move(state)) {}

  /// True when this handle refers to a started collective.
  bool defined() const { return state_ != nullptr; }
  /// True when the transport has finished (wait() will not block).
  bool is_completed() const;
  /// Blocks until the collective finished, runs the local post-processing
  /// once, and returns the result (the same tensor on every later call).
  /// A transport failure or timeout throws an error naming the op, the
  /// group and the collective's sequence number.
  at::Tensor wait();

  const std::shared_ptr<detail::PendingState>& state() const { return state_; }

 private:
  std::shared_ptr<detail::PendingState> state_;
};

/// The group an op runs on: `group` itself, or world() when it is empty.
Group resolve_group(const Group& group);

/// True when a collective of `bytes` on `group` is finished by the time the
/// call returns (a group of one; the shm transport below its async_bytes),
/// so that waiting for it later can overlap nothing.
bool completes_on_call(const Group& group, int64_t bytes);

/// y = reduction over ranks of x (a new contiguous tensor, same shape/dtype).
Pending all_reduce(const at::Tensor& x, const AllReduceOptions& options = {}, const Group& group = Group());
/// All-reduces `x` in place (x must be contiguous); wait() returns x.
/// Example: ops::raw::all_reduce_(bucket, ops::AllReduceOptions().op(ReduceOp::kAvg), dp_group).wait();
Pending all_reduce_(at::Tensor& x, const AllReduceOptions& options = {}, const Group& group = Group());
/// Concatenation of every rank's x along options.dim().
Pending all_gather(const at::Tensor& x, const AllGatherOptions& options = {}, const Group& group = Group());
/// This rank's part (along options.dim()) of the reduction of every rank's x.
Pending reduce_scatter(const at::Tensor& x, const ReduceScatterOptions& options = {}, const Group& group = Group());
/// A copy of src's x on every rank (x gives the shape and dtype on the others).
Pending broadcast(const at::Tensor& x, const BroadcastOptions& options = {}, const Group& group = Group());
/// The reduction of every rank's x on dst; zeros of x's shape on the other ranks.
Pending reduce(const at::Tensor& x, const ReduceOptions& options = {}, const Group& group = Group());
/// Part r (along options.dim()) of src's x on rank r (x gives shape and dtype on the others).
Pending scatter(const at::Tensor& x, const ScatterOptions& options = {}, const Group& group = Group());
/// Concatenation of every rank's x on dst; zeros of that shape on the other ranks.
Pending gather(const at::Tensor& x, const GatherOptions& options = {}, const Group& group = Group());
/// Exchanges parts of x along options.dim() (see AllToAllOptions).
Pending all_to_all(const at::Tensor& x, const AllToAllOptions& options = {}, const Group& group = Group());
/// Sends x to options.dst(); wait() returns an undefined tensor.
Pending send(const at::Tensor& x, const SendOptions& options, const Group& group = Group());
/// Receives a tensor of `sizes` and options.dtype() from options.src().
Pending recv(at::IntArrayRef sizes, const RecvOptions& options, const Group& group = Group());
/// Every rank waits for all the others; wait() returns an undefined tensor.
Pending barrier(const Group& group = Group());

}  // namespace raw
}  // namespace commgrad::ops
