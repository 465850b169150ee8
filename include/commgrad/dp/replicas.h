#pragma once
// Making the replicas of a data-parallel group equal at construction: the
// same parameters everywhere (checked), then the first rank's values
// everywhere (broadcast). DistributedDataParallel, ZeroOptimizer and
// fully_shard start this way.

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace commgrad::dp {

/// A named tensor of a module (parameter or buffer).
using NamedTensor = std::pair<std::string, at::Tensor>;

/// Throws, on every rank of `group` alike and naming `op`, the first
/// parameter or buffer (name, shape, dtype, requires_grad) where a rank's
/// list differs from the group's first rank's. One small all-gather when
/// they agree.
///
/// Example:
///   commgrad::dp::verify_replicas("fully_shard", group, {{"fc.weight", w}}, {});
void verify_replicas(const char* op, const Group& group, const std::vector<NamedTensor>& params,
                     const std::vector<NamedTensor>& buffers);

/// Broadcasts `tensors` from the group's rank 0 in place, packed into byte
/// buffers of at most `cap_bytes` (one broadcast per buffer). Every rank must
/// pass tensors of the same shapes and dtypes in the same order.
void broadcast_from_first(const Group& group, const std::vector<at::Tensor>& tensors, int64_t cap_bytes);

}  // namespace commgrad::dp
