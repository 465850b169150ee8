// Global-norm gradient clipping (see the header for why float64).

#include "commgrad/optim/clip_grad.h"

#include <ATen/ATen.h>

#include <cmath>

namespace commgrad::optim {

double squared_norm(const at::Tensor& t) {
  if (t.numel() == 0) return 0.0;
  return t.detach().to(at::kDouble).square().sum().item<double>();
}

float clip_coefficient(double total_norm, double max_norm) {
  const float norm = static_cast<float>(total_norm);
  const float coef = static_cast<float>(max_norm) / (norm + 1e-6f);
  return coef < 1.0f ? coef : 1.0f;
}

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm) {
  TORCH_CHECK(max_norm > 0, "[commgrad] clip_grad_norm_: max_norm must be positive, got ", max_norm);
  at::NoGradGuard no_grad;
  double sum = 0;
  for (const auto& p : parameters) {
    if (p.grad().defined()) sum += squared_norm(p.grad());
  }
  const double norm = std::sqrt(sum);
  const float coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0f) {
    for (const auto& p : parameters) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return norm;
}

}  // namespace commgrad::optim
