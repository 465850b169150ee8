#pragma once
// Gradient clipping by the global L2 norm, computed so that a sharded
// optimizer and an unsharded one get the same clip factor: squares are
// accumulated in float64 (so the order in which shards are summed changes
// the total only far below float32 resolution), then the norm and the factor
// are rounded to float32 as torch::nn::utils::clip_grad_norm_ rounds them.

#include <ATen/core/Tensor.h>

#include <vector>

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

}  // namespace commgrad::optim
