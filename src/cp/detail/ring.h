#pragma once
// Ring attention (ring.cpp), the kRing mode of cp::attention.

#include "commgrad/cp/attention.h"

namespace commgrad::cp::detail {

/// cp::attention in ring mode; the arguments are checked by the caller.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const ContextParallelOptions& options);

}  // namespace commgrad::cp::detail
