#pragma once
// The context of one raw call (internal to commgrad_ops).

#include "commgrad/detail/torch_compat.h"
#include "commgrad/dist/group.h"
#include "commgrad/ops/raw.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace commgrad::ops::detail {

/// One raw call: op name, resolved group, rank, size, and the sequence number
/// taken once the local checks passed.
struct Call {
  Call(const char* op, const Group& group);
  const char* op;
  Group group;
  int rank;
  int size;
  uint64_t sequence = 0;
  uint64_t record = ~uint64_t{0};  // the flight recorder's number of this call (none: not recorded)

  /// Takes the sequence number and records the call in the flight recorder
  /// (queued; the terminate handler names it until it finishes) with the
  /// dtype and sizes of `x` (none for a barrier): call after every local check.
  void start(const at::Tensor& x = at::Tensor());
  /// The transport that carries tensors on x's device (CUDA tensors may have their own).
  commgrad::detail::TransportBase& transport(const at::Tensor& x) const { return group.transport(x.device().type()); }
  /// What that transport offers beyond c10d (dist/transport.h).
  const commgrad::detail::TransportCapabilities& capabilities(const at::Tensor& x) const {
    return group.capabilities(x.device().type());
  }
  /// A Pending that is already complete with `result`.
  raw::Pending ready(at::Tensor result) const;
  /// A Pending for `works`, finished by `finish` (which may wait on further
  /// steps through wait_step()).
  raw::Pending pending(std::vector<commgrad::detail::WorkPtr> works, std::function<at::Tensor()> finish) const;
};

}  // namespace commgrad::ops::detail
