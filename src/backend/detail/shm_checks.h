#pragma once
// The argument checks of a ShmProcessGroup collective (ShmProcessGroup::Checks).
// Header-only: every check sits on the path of every call, and only the
// message of a failed one is built.

#include "commgrad/backend/shm_process_group.h"

#include "detail/shm_comm.h"
#include "detail/shm_staged.h"

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>
#include <c10/util/StringUtil.h>

#include <string>

namespace commgrad::backend {

namespace detail {

// The engine's form of `op`; *ok false when shm does not know it.
inline RedOp to_red_op(const c10d::ReduceOp& op, bool* ok) {
  *ok = true;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return RedOp::kSum;
    case c10d::ReduceOp::AVG:
      return RedOp::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return RedOp::kProduct;
    case c10d::ReduceOp::MIN:
      return RedOp::kMin;
    case c10d::ReduceOp::MAX:
      return RedOp::kMax;
    case c10d::ReduceOp::BAND:
      return RedOp::kBand;
    case c10d::ReduceOp::BOR:
      return RedOp::kBor;
    case c10d::ReduceOp::BXOR:
      return RedOp::kBxor;
    default:
      *ok = false;
      return RedOp::kSum;
  }
}

}  // namespace detail

/// The argument checks of one collective call: each op makes one, naming
/// itself and the kind of collective that a rejection queues in its place
/// (see reject()), and spells out its checks through it. A failed check
/// throws "[commgrad] <op> rank r/n group 'g' (shm): <message>". The
/// message parts are only joined into a string when a check fails.
class ShmProcessGroup::Checks {
 public:
  Checks(ShmProcessGroup& group, const char* op, detail::OpKind kind) : group_(group), op_(op), kind_(kind) {}

  const char* op() const { return op_; }

  /// Rejects the call unless `ok`, with the message c10::str(message...).
  /// Always inlined, as the macro it replaces was: a test and a branch.
  template <typename... Message>
  C10_ALWAYS_INLINE void require(bool ok, const Message&... message) const {
    if (C10_UNLIKELY(!ok)) group_.reject(op_, static_cast<int>(kind_), c10::str(message...));
  }

  /// `t`, which the message calls `what` ("the input"), must be a dense CPU tensor.
  void tensor(const at::Tensor& t, const char* what) const {
    if (C10_UNLIKELY(!detail::is_cpu_dense(t))) not_cpu_dense(t, what);
  }
  /// The same for tensor `index` of a list, which the message calls "`what` `index`" ("output 2").
  void tensor(const at::Tensor& t, const char* what, int64_t index) const {
    if (C10_UNLIKELY(!detail::is_cpu_dense(t))) not_cpu_dense(t, c10::str(what, " ", index));
  }

  /// The engine's form of `reduce_op`, which must be one shm knows and one it can apply to `dtype`.
  detail::RedOp reduction(const c10d::ReduceOp& reduce_op, at::ScalarType dtype) const {
    bool known = false;
    const detail::RedOp red = detail::to_red_op(reduce_op, &known);
    require(known, "reduce op ", static_cast<int>(reduce_op.op_),
            " is not supported by shm (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR are)");
    std::string why;
    require(detail::reduction_supported(dtype, red, &why), why);
    return red;
  }

 private:
  [[noreturn]] void not_cpu_dense(const at::Tensor& t, const std::string& what) const {
    group_.reject(op_, static_cast<int>(kind_),
                  c10::str(what, " must be a defined CPU tensor with strided layout, got ",
                           t.defined() ? c10::str(t.device(), " ", t.layout()) : std::string("an undefined tensor")));
  }

  ShmProcessGroup& group_;
  const char* op_;
  detail::OpKind kind_;
};

}  // namespace commgrad::backend
