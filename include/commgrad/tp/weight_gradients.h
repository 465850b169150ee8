#pragma once
// Weight gradients held back from backward, for zero-bubble pipeline
// schedules (Qi et al., arXiv 2401.10241), which split a stage's backward
// into B (the input gradient, on the critical path between stages) and W
// (the weight gradients, which nothing downstream waits for, run later to
// fill the bubble).
//
// commgrad's linear layers (ColumnParallelLinear, RowParallelLinear and so
// every layer built of them) whose forward runs while a
// DeferWeightGradients guard is alive compute in backward only their input
// gradient; what their weight gradient needs (the layer input and the
// output gradient) goes into the guard's WeightGradients, and compute()
// does the matmuls later. Everything else of the backward (biases, norms,
// embeddings, attention) happens in the backward as usual.
//
// The weight gradients computed are the ones backward would have computed,
// bit for bit, and compute() accumulates them into `.grad()` through
// autograd, so gradient hooks (DistributedDataParallel's, ZeroOptimizer's)
// fire for them then.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>

namespace commgrad::tp {

/// The weight gradients deferred by the layers of one forward (e.g. one
/// microbatch on one pipeline stage).
///
/// Example:
///   tp::WeightGradients weights;
///   at::Tensor y;
///   {
///     tp::DeferWeightGradients defer(weights);
///     y = mlp(x);
///   }
///   y.backward(dy);      // B: x.grad(), and the biases' gradients
///   weights.compute();   // W: the weights' gradients
class WeightGradients {
 public:
  WeightGradients();
  ~WeightGradients();
  WeightGradients(WeightGradients&&) noexcept;
  WeightGradients& operator=(WeightGradients&&) noexcept;

  /// How many weight gradients wait (one per layer whose backward ran).
  size_t size() const;
  bool empty() const { return size() == 0; }
  /// How many layer forwards deferred into this (since it was made or
  /// cleared): their backward will add their weight gradients here.
  size_t deferring_layers() const;
  /// Computes every waiting weight gradient and accumulates it into its
  /// weight's .grad() in one autograd call (the weights' gradient hooks
  /// fire), then forgets them. Nothing waiting: does nothing.
  void compute();
  /// Forgets the waiting gradients (and the count of deferring layers)
  /// without computing them.
  void clear();

  /// Internal: the layers' way in. `gradient` returns the gradient of
  /// `weight` (same shape and dtype).
  struct Queue;
  const std::shared_ptr<Queue>& queue() const { return queue_; }

 private:
  std::shared_ptr<Queue> queue_;
};

/// While alive, the linear layers' forwards on this thread defer their
/// weight gradients into `into` (which must outlive their backward or be
/// cleared). Guards nest; the innermost wins.
class DeferWeightGradients {
 public:
  explicit DeferWeightGradients(WeightGradients& into);
  ~DeferWeightGradients();
  DeferWeightGradients(const DeferWeightGradients&) = delete;
  DeferWeightGradients& operator=(const DeferWeightGradients&) = delete;

 private:
  std::shared_ptr<WeightGradients::Queue> previous_;
};

namespace detail {

/// The queue of the innermost DeferWeightGradients on this thread (null
/// when there is none): a layer's forward saves it for its backward.
std::shared_ptr<WeightGradients::Queue> deferring_weight_gradients();

/// Makes `queue` (null: none) the one this thread's layer forwards defer
/// into, as a DeferWeightGradients guard would; returns the previous one.
/// recompute() uses it to rerun a function under the queue its forward ran
/// under, so that the rerun's layers defer their weight gradients there.
std::shared_ptr<WeightGradients::Queue> exchange_deferring_weight_gradients(
    std::shared_ptr<WeightGradients::Queue> queue);

/// Counts a layer forward that saved `queue` for its backward.
void note_deferring_layer(WeightGradients::Queue& queue);

/// Adds a weight gradient to `queue`: `gradient()` is called by compute().
void defer_weight_gradient(WeightGradients::Queue& queue, const at::Tensor& weight,
                           std::function<at::Tensor()> gradient);

}  // namespace detail
}  // namespace commgrad::tp
