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

// The rest of a split average, once the sum has arrived.
std::function<void()> post_divide(const at::Tensor& buffer, double factor) {
  if (factor == 1) return nullptr;
  return [buffer, factor] { buffer.div_(factor); };
}

CommWork sum_in_place(at::Tensor flat, const Group& group, double factor) {
  return CommWork{ops::raw::all_reduce_(flat, {}, group), post_divide(flat, factor)};
}

// Sums `bucket` through a copy in `wire_dtype`, written back when done.
CommWork sum_compressed(GradBucket& bucket, at::ScalarType wire_dtype) {
  const auto& buffer = bucket.buffer();
  if (bucket.group().size() == 1) return CommWork{{}, post_divide(buffer, bucket.post_divide())};
  if (buffer.scalar_type() == wire_dtype) return sum_in_place(buffer, bucket.group(), bucket.post_divide());
  auto wire = buffer.to(wire_dtype);
  const double factor = bucket.post_divide();
  return CommWork{ops::raw::all_reduce_(wire, {}, bucket.group()), [buffer, wire, factor] {
                    buffer.copy_(wire);
                    if (factor != 1) buffer.div_(factor);
                  }};
}

}  // namespace

CommHook allreduce_hook() {
  return [](GradBucket& bucket) -> CommWork {
    if (bucket.group().size() == 1) return CommWork{{}, post_divide(bucket.buffer(), bucket.post_divide())};
    return sum_in_place(bucket.buffer(), bucket.group(), bucket.post_divide());
  };
}

CommHook fp16_compress_hook() {
  return [](GradBucket& bucket) { return sum_compressed(bucket, at::kHalf); };
}

CommHook bf16_compress_hook() {
  return [](GradBucket& bucket) { return sum_compressed(bucket, at::kBFloat16); };
}

}  // namespace commgrad::dp
