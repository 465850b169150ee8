#pragma once
// Asynchronous forms of the commgrad::ops collectives.
//
// `ops::all_reduce_async(x)` validates and starts the collective and returns
// at once; `wait()` blocks until it finished and returns the same result,
// with the same autograd graph, as `ops::all_reduce(x)`. The autograd node is
// created inside wait(), after the transport finished, so no gradient and no
// reader can see the buffer before its collective is done. Between the call
// and wait() the input must not be modified in place.
//
// Example:
//   auto pending = ops::all_gather_async(x, ops::AllGatherOptions().dim(0));
//   auto local = expensive(z);           // overlaps with the all_gather
//   auto y = pending.wait();             // differentiable, like ops::all_gather(x)

#include "commgrad/ops/collectives.h"
#include "commgrad/ops/raw.h"

#include <functional>
#include <memory>

namespace commgrad::ops {

/// A collective in flight whose result is a tensor.
class AsyncTensor {
 public:
  /// Turns the finished raw result into the autograd-visible result.
  using Finish = std::function<at::Tensor(raw::Pending&)>;

  AsyncTensor() = default;
  AsyncTensor(raw::Pending pending, Finish finish);

  /// True when this handle refers to a started collective.
  bool defined() const { return state_ != nullptr; }
  /// True when the transport has finished (wait() will not block).
  bool is_completed() const;
  /// Blocks until done and returns the result (the same tensor on every call).
  at::Tensor wait();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

/// A collective in flight without a result (barrier).
class Handle {
 public:
  Handle() = default;
  explicit Handle(raw::Pending pending) : pending_(std::move(pending)) {}

  bool defined() const { return pending_.defined(); }
  bool is_completed() const { return pending_.is_completed(); }
  /// Blocks until done; throws when the collective failed or timed out.
  void wait() { pending_.wait(); }

 private:
  raw::Pending pending_;
};

/// Asynchronous ops::all_reduce.
AsyncTensor all_reduce_async(const at::Tensor& x, const AllReduceOptions& options = {}, const Group& group = Group());
/// Asynchronous ops::all_gather.
AsyncTensor all_gather_async(const at::Tensor& x, const AllGatherOptions& options = {}, const Group& group = Group());
/// Asynchronous ops::reduce_scatter.
AsyncTensor reduce_scatter_async(const at::Tensor& x, const ReduceScatterOptions& options = {},
                                 const Group& group = Group());
/// Asynchronous ops::broadcast.
AsyncTensor broadcast_async(const at::Tensor& x, const BroadcastOptions& options = {}, const Group& group = Group());
/// Asynchronous ops::reduce.
AsyncTensor reduce_async(const at::Tensor& x, const ReduceOptions& options = {}, const Group& group = Group());
/// Asynchronous ops::scatter.
AsyncTensor scatter_async(const at::Tensor& x, const ScatterOptions& options = {}, const Group& group = Group());
/// Asynchronous ops::gather.
AsyncTensor gather_async(const at::Tensor& x, const GatherOptions& options = {}, const Group& group = Group());
/// Asynchronous ops::all_to_all.
AsyncTensor all_to_all_async(const at::Tensor& x, const AllToAllOptions& options = {}, const Group& group = Group());
/// Asynchronous ops::send (wait() gives the token).
AsyncTensor send_async(const at::Tensor& x, const SendOptions& options, const Group& group = Group());
/// Asynchronous ops::recv.
AsyncTensor recv_async(at::IntArrayRef sizes, const RecvOptions& options, const Group& group = Group());
/// Asynchronous ops::barrier.
Handle barrier_async(const Group& group = Group());

}  // namespace commgrad::ops
