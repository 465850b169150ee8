#pragma once
// How tensors are put on the transport (internal to commgrad_ops): which
// dtypes travel natively, which as bytes, and what a reduction runs in.

#include "call.h"
#include "commgrad/ops/reduce_op.h"

#include <ATen/core/Tensor.h>

namespace commgrad::ops::detail {

/// True when every transport moves this dtype natively (else it travels as bytes).
bool wire_native(at::ScalarType dtype);
/// A flat 1-D view of contiguous `t` in a dtype the transport carries.
at::Tensor wire(const at::Tensor& t);
/// Elements of wire(t) per element of t.
int64_t wire_scale(at::ScalarType dtype);
/// The flat tensor a transport reduces: complex travels as pairs of reals.
at::Tensor reduce_wire(const at::Tensor& buffer);
/// The dtype a reduction of `dtype` runs in on the transport of `x`: float32
/// for float16 and bfloat16 unless that transport reduces them natively
/// (accumulating in float32 itself); checks that `op` is defined for `dtype`.
at::ScalarType reduce_dtype(const Call& call, const at::Tensor& x, ReduceOp op);
/// The c10d reduction that implements `op` (AVG runs as SUM).
c10d::ReduceOp to_c10d(ReduceOp op);

}  // namespace commgrad::ops::detail
