#pragma once
// The LayerNorm a transformer layer and its one-rank reference both build.

#include <torch/nn/modules/normalization.h>

#include <cstdint>

namespace commgrad::tp::detail {

inline torch::nn::LayerNorm make_layernorm(int64_t hidden_size, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden_size}).eps(eps));
}

}  // namespace commgrad::tp::detail
