// Communication hooks of DistributedDataParallel.
//
// Each hook sums one bucket's flat buffer over the group and leaves the sum
// there; DDP has already divided the buffer by the group size when it
// averages. allreduce_hook is one asynchronous in-place SUM all-reduce.
// fp16_compress_hook and bf16_compress_hook convert the bucket to 16 bits,
// sum that, and convert back in their completion step. Every sum is an
// ops::raw all-reduce: how a transport reduces a 16-bit buffer (natively,
// or through float32 where it cannot accumulate in float32) is decided there.
//
// A group of one rank needs no communication; the hooks then do nothing.

#include "commgrad/dp/comm_hooks.h"

#include <ATen/ATen.h>

namespace commgrad::dp {
namespace {

CommWork sum_in_place(at::Tensor flat, const Group& group) {
  return CommWork{ops::raw::all_reduce_(flat, {}, group), nullptr};
}

// Sums `bucket` through a copy in `wire_dtype`, written back when done.
CommWork sum_compressed(GradBucket& bucket, at::ScalarType wire_dtype) {
  const auto& buffer = bucket.buffer();
  if (bucket.group().size() == 1) return {};
  if (buffer.scalar_type() == wire_dtype) return sum_in_place(buffer, bucket.group());
  auto wire = buffer.to(wire_dtype);
  return CommWork{ops::raw::all_reduce_(wire, {}, bucket.group()), [buffer, wire] { buffer.copy_(wire); }};
}

}  // namespace

CommHook allreduce_hook() {
  return [](GradBucket& bucket) -> CommWork {
    if (bucket.group().size() == 1) return {};
    return sum_in_place(bucket.buffer(), bucket.group());
  };
}

CommHook fp16_compress_hook() {
  return [](GradBucket& bucket) { return sum_compressed(bucket, at::kHalf); };
}

CommHook bf16_compress_hook() {
  return [](GradBucket& bucket) { return sum_compressed(bucket, at::kBFloat16); };
}

}  // namespace commgrad::dp
