#pragma once
// Cross entropy over logits whose vocabulary dim is split across the
// tensor-parallel group (the output of a ColumnParallelLinear without
// gather_output), without ever gathering the logits.
//
// Rank r holds logits for vocabulary entries [r V/n, (r+1) V/n). Forward:
// the row maximum is all-reduced (MAX) and subtracted for numerical
// stability; then the target logit (found on the rank that owns the target),
// the sum of exponentials and, with label smoothing, the sum of logits are
// all-reduced (SUM) together in one collective. Backward is local: each rank
// computes softmax - (1 - eps) onehot - eps / V on its own slice.
//
// ignore_index and label smoothing follow torch::nn::functional::cross_entropy
// over the GLOBAL vocabulary V, so TP = n gives the TP = 1 loss (Megatron's
// version smooths over the local vocabulary V/n, which differs).

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

namespace commgrad::tp {

/// How per-token losses are combined (as in torch::nn::functional::cross_entropy).
enum class Reduction {
  kNone,  ///< per-token loss, shaped like the target (0 where ignored)
  kMean,  ///< mean over the tokens not ignored
  kSum,   ///< sum over the tokens
};

/// Options of vocab_parallel_cross_entropy().
///
/// Example:
///   tp::CrossEntropyOptions().ignore_index(0).label_smoothing(0.1).reduction(tp::Reduction::kSum)
struct CrossEntropyOptions {
  /// Tensor-parallel group; empty: the current parallel state's.
  TORCH_ARG(Group, group) = Group();
  /// Target value whose tokens add no loss and get no gradient.
  TORCH_ARG(int64_t, ignore_index) = -100;
  /// eps in [0, 1]: the target distribution is (1 - eps) onehot + eps / V.
  TORCH_ARG(double, label_smoothing) = 0.0;
  TORCH_ARG(Reduction, reduction) = Reduction::kMean;
};

/// Cross entropy of vocabulary-parallel `logits` [.., V/n] (float) against
/// global target ids `target` [..] (int64, identical on every TP rank).
/// Collective (two small all-reduces). The logits are not modified; the
/// computation runs in float32 for half-precision logits.
/// backward: local, no communication.
///
/// Example:
///   auto logits = lm_head(h);                                    // [tokens, V/n]
///   auto loss = tp::vocab_parallel_cross_entropy(logits, targets);  // scalar, replicated
///   loss.backward();
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const CrossEntropyOptions& options = {});

}  // namespace commgrad::tp
