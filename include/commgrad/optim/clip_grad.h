#pragma once
// Gradient clipping by the global L2 norm, computed so that a sharded
// optimizer and an unsharded one get the same clip factor: squares are
// accumulated in float64 (so the order in which shards are summed changes
// the total only far below float32 resolution), then the norm and the factor
// are rounded to float32 as torch::nn::utils::clip_grad_norm_ rounds them.

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace commgrad::optim {

/// Sum of the squares of `t`'s elements, accumulated in float64.
double squared_norm(const at::Tensor& t);

/// The factor gradients are multiplied by: max_norm / (norm + 1e-6) in float32
/// when that is below 1, else 1 (torch::nn::utils::clip_grad_norm_'s rule).
float clip_coefficient(double total_norm, double max_norm);

/// Scales the gradients of `parameters` in place so that their global L2 norm
/// is at most `max_norm`; returns the norm before clipping. Parameters without
/// a gradient are skipped. The unsharded counterpart of ZeroOptimizer's
/// clipping (the same factor, bit for bit in practice).
///
/// Example:
///   loss.backward();
///   double norm = commgrad::optim::clip_grad_norm_(model->parameters(), 1.0);
///   opt.step();
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm);

/// The same over every parameter of a tensor-parallel `module` (with
/// DistributedDataParallel: after backward, when every data-parallel rank
/// holds the averaged gradients): the norm sums the partitioned parameters'
/// shards over `tensor_parallel` and counts TP-replicated parameters once,
/// then sums over `pipeline_parallel` (a pipeline stage). Groups not given
/// are the current layout's (when above one rank); without a layout the TP
/// group is the one the module's parameters are split over, and a given one
/// other than theirs is an error. Call tp::allreduce_sequence_parallel_grads()
/// first under sequence parallelism. Collective over those groups. (A list of
/// parameters cannot say which are shards: the overload above clips a TP
/// rank by the norm of its own shards.)
///
/// Example:
///   loss.backward();                                           // DDP averages over DP
///   commgrad::optim::clip_grad_norm_(*model, 1.0);             // groups from the layout
///   opt.step();
double clip_grad_norm_(const torch::nn::Module& module, double max_norm, const Group& tensor_parallel = Group(),
                       const Group& pipeline_parallel = Group());

}  // namespace commgrad::optim
