#pragma once
// The reductions a collective can apply, independent of the transport.

#include <ostream>

namespace commgrad {

/// How all_reduce, reduce and reduce_scatter combine the ranks' tensors.
///
/// Every transport gets every reduction: where one lacks it (Gloo has no AVG)
/// commgrad builds it from what exists (SUM, then a local division).
///
/// Example:
///   auto mean = commgrad::ops::all_reduce(x, commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kAvg));
enum class ReduceOp {
  kSum,      ///< elementwise sum
  kAvg,      ///< elementwise mean over the group (floating-point tensors only)
  kMax,      ///< elementwise maximum
  kMin,      ///< elementwise minimum
  kProduct,  ///< elementwise product (forward only: it has no gradient in commgrad)
};

/// "sum", "avg", "max", "min", "product".
const char* reduce_op_name(ReduceOp op);

inline std::ostream& operator<<(std::ostream& out, ReduceOp op) { return out << reduce_op_name(op); }

}  // namespace commgrad
