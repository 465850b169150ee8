#pragma once
// Activation recomputation (Megatron's CheckpointFunction,
// torch.utils.checkpoint): run a function in forward without keeping its
// activations, and run it again, with grad, when backward reaches it.
//
// recompute(fn, inputs) calls fn(inputs) under NoGradGuard and keeps only
// what a rerun needs: the inputs (aliases, not copies), their version
// counters, and the state of every random stream fn may draw from
// (LibTorch's default CPU generator, every stream of this thread's
// tp::RngTracker and which of them was forked, and the default CUDA
// generator of each CUDA device the inputs live on). Its outputs get one
// autograd node; when backward reaches it, the node restores those states,
// reruns fn with grad on detached copies of the inputs, back-propagates the
// incoming gradients through the rerun, puts the random streams back as it
// found them, and hands the gradients of the inputs and of the declared
// parameters to the engine, which accumulates them as it would without
// recompute (in the outer backward, with their hooks, where DDP's reducer
// expects them); parameters fn reads but that were not declared are
// accumulated by a nested engine call. Random draws, and so dropout masks,
// are bit for bit those of the forward.
//
// This is the *reentrant* form (the rerun's graph is back-propagated by a
// nested engine call): LibTorch's non-reentrant form rests on default
// saved-tensor hooks, which only Python's engine provides
// (Engine::get_default_saved_variable_hooks() is null in C++). See
// docs/recompute.md for what composes with what.

#include "commgrad/tp/random.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <string>
#include <vector>

namespace commgrad::tp {

/// What a layer recomputes in backward (Megatron's recompute_granularity).
enum class RecomputeGranularity {
  kNone,       ///< keep every activation
  kSelective,  ///< recompute the attention core softmax(QK^T)V (the s^2 part); no collective is re-issued
  kFull,       ///< keep only the layer's input; the whole layer, its collectives included, runs again
};

/// "none", "selective" or "full".
const char* recompute_granularity_name(RecomputeGranularity granularity);

/// A function recompute() may run twice: tensors in, tensors out. Non-tensor
/// arguments are captured by the lambda; tensors that need gradients must be
/// among the inputs or be leaves (parameters), never activations computed
/// outside it.
using RecomputeFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Options of recompute().
///
/// Example:
///   tp::RecomputeOptions().name("layers.3").parameters(layer->parameters())
struct RecomputeOptions {
  /// Names the function in errors ("recompute 'layers.3': ...").
  TORCH_ARG(std::string, name) = "recompute";
  /// Leaves (parameters) fn reads. Their gradients go back to the engine with
  /// the inputs' gradients: they are accumulated in the outer backward, where
  /// gradient hooks (DDP, fully_shard) expect them. Parameters fn reads but
  /// that are not declared are found in the rerun's graph and accumulated
  /// there, by a nested engine call (Megatron's behaviour): right without
  /// hooks, but DDP's reducer must not see its first gradient of a backward
  /// there (see docs/recompute.md).
  TORCH_ARG(std::vector<at::Tensor>, parameters);
  /// Replay the random streams (off: the rerun draws new numbers, as
  /// torch.utils.checkpoint's preserve_rng_state=False).
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// With preserve_rng_state: each floating-point output's sum (one read of
  /// the output, in at least float32) is kept at forward and the rerun's
  /// must equal it bit for bit, or backward stops with an error naming the
  /// function (a random source or a state recompute does not replay: a
  /// generator of the function's own, a buffer that changed). Off: for a
  /// function whose rerun is not bitwise reproducible by design (a
  /// nondeterministic GPU kernel).
  TORCH_ARG(bool, check_rerun) = true;
};

/// Runs fn(inputs) without keeping its activations; backward reruns it (see
/// the file comment). Returns fn's outputs: under grad mode, the
/// floating-point ones require grad (through recompute's node), whether or
/// not any input does, as a module with parameters would. Outside grad mode
/// it is fn(inputs).
///
/// Errors (c10::Error naming the function): an input modified in place
/// between forward and backward, or by fn itself; an output whose number,
/// shape, dtype or device differs in the rerun, or (check_rerun) whose
/// values do; a tensor that requires grad reached in the rerun's graph
/// that is neither an input nor a leaf.
///
/// Example:
///   auto out = tp::recompute(
///       [&](const std::vector<at::Tensor>& in) {
///         auto h = tp::dropout(torch::gelu(fc1->forward(in[0])), 0.1, true);
///         return std::vector<at::Tensor>{fc2->forward(h)};
///       },
///       {x}, tp::RecomputeOptions().name("mlp").parameters(mlp->parameters()))[0];
std::vector<at::Tensor> recompute(const RecomputeFunction& fn, const std::vector<at::Tensor>& inputs,
                                  const RecomputeOptions& options = {});

/// The tensors recompute() keeps for the rerun of the call that made
/// `output` (aliases of its inputs, in order; undefined where an input
/// was undefined), while its backward has not run; empty when `output` is not an
/// output of recompute() (or came from it outside grad mode). What a
/// recomputed layer holds for backward, e.g. 1/TP of the sequence under
/// sequence parallelism.
///
/// Example:
///   auto y = layer(chunk);   // full recompute
///   int64_t kept = tp::recompute_saved_inputs(y)[0].numel();   // chunk.numel()
std::vector<at::Tensor> recompute_saved_inputs(const at::Tensor& output);

/// One tensor in, one tensor out.
///
/// Example:
///   auto y = tp::recompute([&](const at::Tensor& x) { return layer->forward(x); }, x);
at::Tensor recompute(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                     const RecomputeOptions& options = {});

}  // namespace commgrad::tp
