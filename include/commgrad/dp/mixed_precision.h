#pragma once
// The mixed-precision policy of the data-parallel wrappers (FSDP2's
// MixedPrecisionPolicy), one struct for fsdp::fully_shard,
// dp::DistributedDataParallel and optim::ZeroOptimizer: which dtype the
// parameters are computed in, which dtype gradients are reduced in, which
// dtype the outputs come out in, and whether the optimizer steps float32
// master copies of 16-bit parameters.
//
// What each wrapper does with it:
//   field          fully_shard               ZeroOptimizer              DistributedDataParallel
//   param_dtype    gathers in it             casts the parameters       casts the parameters
//   reduce_dtype   reduce-scatters in it     buckets in it              buckets in it
//   float32_master shards stay float32       its ranges in float32      (the caller's optimizer)
//   output_dtype   casts the root's outputs  error (forward not wrapped)

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
  /// True when no dtype is set (the wrappers then keep their behaviour
  /// without a policy).
  bool full_precision() const { return !param_dtype() && !reduce_dtype() && !output_dtype(); }

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
  /// float16/bfloat16 parameters are stepped through float32 copies (master
  /// weights) that the optimizer updates and the parameters take rounded.
  /// ZeroOptimizer keeps its ranges' copies; fully_shard's shards keep the
  /// parameters' own dtype (float32 when the model is); DDP leaves the step
  /// to the caller's optimizer.
  TORCH_ARG(bool, float32_master) = true;
};

/// Errors (naming `op`) unless every dtype the policy sets is a floating type.
void check_policy(const MixedPrecisionPolicy& policy, const char* op);

/// The factor a sum over `world_size` ranks in a 16-bit dtype divides by
/// before the reduction (the rest, world_size / factor, after it): about
/// sqrt(world_size), a power of two (FSDP's gradient pre-divide factor).
double predivide_factor(int64_t world_size);

/// The division of an average over `divisor` ranks: all of it before the
/// sum, except for 16-bit reductions under a policy (`!full_precision()`),
/// which divide by predivide_factor(divisor) before and the rest after.
struct AverageSplit {
  double before = 1;
  double after = 1;
};
AverageSplit split_average(const MixedPrecisionPolicy& policy, at::ScalarType reduce_dtype, int64_t divisor);

}  // namespace commgrad::dp
