// Putting tensors on the transport: native dtypes, bytes, reduction dtypes.

#include "detail/wire.h"

#include "commgrad/dist/check.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>

namespace commgrad::ops::detail {

bool wire_native(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

at::Tensor wire(const at::Tensor& t) {
  // Below the view-tracking layer: an autograd view would keep a reference
  // to `t` itself for as long as the transport holds the wire tensor, and
  // a result with a second reference is copied by autograd (AccumulateGrad
  // steals only a gradient nobody else holds).
  at::AutoDispatchBelowADInplaceOrView untracked;
  auto flat = t.view({-1});
  return wire_native(t.scalar_type()) ? flat : flat.view(at::kByte);
}

int64_t wire_scale(at::ScalarType t) { return wire_native(t) ? 1 : static_cast<int64_t>(c10::elementSize(t)); }

at::Tensor reduce_wire(const at::Tensor& buffer) {
  at::AutoDispatchBelowADInplaceOrView untracked;  // see wire()
  return at::isComplexType(buffer.scalar_type()) ? at::view_as_real(buffer).view({-1}) : buffer.view({-1});
}

at::ScalarType reduce_dtype(const Call& call, const at::Tensor& x, ReduceOp op) {
  const at::ScalarType t = x.scalar_type();
  const bool complex = at::isComplexType(t);
  const bool floating = at::isFloatingType(t);
  COMMGRAD_CHECK(!(op == ReduceOp::kAvg && !floating && !complex), call.op, call.group,
                 "AVG needs a floating-point tensor, got ", dtype_name(t), " (use SUM and divide)");
  COMMGRAD_CHECK(!(complex && op != ReduceOp::kSum && op != ReduceOp::kAvg), call.op, call.group, reduce_op_name(op),
                 " is not defined for complex tensors (", dtype_name(t), ")");
  if (t == at::kHalf || t == at::kBFloat16) {
    // Gloo has no bfloat16 and sums float16 slowly in float16; a transport
    // that accumulates 16-bit types in float32 itself needs no copy. See docs/benchmarks.md.
    return call.size > 1 && call.capabilities(x).reduces_16bit ? t : at::kFloat;
  }
  if (complex || wire_native(t)) return t;
  COMMGRAD_CHECK(false, call.op, call.group, "reductions of ", dtype_name(t),
                 " tensors are not supported (supported: float16, bfloat16, float32, float64, complex, int8, "
                 "uint8, int32, int64)");
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kProduct:
      return c10d::ReduceOp::PRODUCT;
  }
  return c10d::ReduceOp::SUM;
}

}  // namespace commgrad::ops::detail
