// Names of the reductions.

#include "commgrad/ops/reduce_op.h"

namespace commgrad {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kProduct:
      return "product";
  }
  return "?";
}

}  // namespace commgrad
