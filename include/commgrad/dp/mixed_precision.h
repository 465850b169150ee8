#pragma once
// The mixed-precision policy of the data-parallel wrappers (FSDP2's
// MixedPrecisionPolicy): which dtype the parameters are computed in, which
// dtype gradients are reduced in, and which dtype the outputs come out in,
// while the optimizer steps float32 master copies.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <string>

namespace commgrad::dp {

/// Mixed precision for a data-parallel wrapper.
///
/// Example (compute in bfloat16, reduce gradients in float32):
///   commgrad::dp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)
struct MixedPrecisionPolicy {
  /// "param bfloat16, reduce float32" ("full precision" when all are unset).
  std::string describe() const;
  /// The dtype a parameter of `own` dtype computes in.
  at::ScalarType compute_dtype(at::ScalarType own) const { return param_dtype().value_or(own); }
  /// The dtype a gradient of a parameter of `own` dtype is reduced in.
  at::ScalarType reduction_dtype(at::ScalarType own) const { return reduce_dtype().value_or(compute_dtype(own)); }

  /// The dtype forward and backward compute in: the unsharded parameters
  /// are cast to it (nullopt: the parameters' own dtype).
  TORCH_ARG(c10::optional<at::ScalarType>, param_dtype);
  /// The dtype gradients are reduced in (nullopt: param_dtype). float16 and
  /// bfloat16 reductions divide by a factor before the sum and by the rest
  /// after it (FSDP's pre/post divide), so that sums do not overflow.
  TORCH_ARG(c10::optional<at::ScalarType>, reduce_dtype);
  /// Floating outputs of the outermost wrapped call are cast to this dtype
  /// (nullopt: left as computed).
  TORCH_ARG(c10::optional<at::ScalarType>, output_dtype);
};

/// Errors (naming `op`) unless every dtype the policy sets is a floating type.
void check_policy(const MixedPrecisionPolicy& policy, const char* op);

/// The factor a sum over `world_size` ranks in a 16-bit dtype divides by
/// before the reduction (the rest, world_size / factor, after it): about
/// sqrt(world_size), a power of two (FSDP's gradient pre-divide factor).
double predivide_factor(int64_t world_size);

}  // namespace commgrad::dp
