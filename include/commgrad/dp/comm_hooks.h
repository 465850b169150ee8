#pragma once
// Communication hooks of DistributedDataParallel: how one bucket of
// gradients is summed over the data-parallel group (plain all-reduce, or
// compressed to fp16 / bf16 on the wire).

#include "commgrad/dist/group.h"
#include "commgrad/ops/raw.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace commgrad::dp {

/// One bucket of gradients, as a communication hook sees it.
///
/// `buffer()` is a flat, contiguous 1-D tensor holding the bucket's local
/// gradients back to back (in bucket order), then zeros up to the
/// bucket_multiple option's multiple. When DistributedDataParallel
/// averages, the buffer is already divided by the group size, so a hook only
/// has to *sum* it over `group()` and leave the sum in `buffer()`. A 16-bit
/// reduction under a mixed-precision policy divides only part of the average
/// before the sum: the hook divides the sum by `post_divide()` (1 otherwise)
/// once it has arrived.
///
/// Example (inside a hook):
///   auto buffer = bucket.buffer();
///   return commgrad::dp::CommWork{commgrad::ops::raw::all_reduce_(buffer, {}, bucket.group()), nullptr};
class GradBucket {
 public:
  GradBucket(size_t index, size_t count, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<std::string> names, Group group, double post_divide = 1)
      : index_(index),
        count_(count),
        buffer_(std::move(buffer)),
        gradients_(std::move(gradients)),
        names_(std::move(names)),
        group_(std::move(group)),
        post_divide_(post_divide) {}

  /// Position of the bucket (0 is reduced first) and the number of buckets.
  size_t index() const { return index_; }
  size_t count() const { return count_; }
  bool is_last() const { return index_ + 1 == count_; }
  /// The flat gradients; the hook leaves their sum over the group here.
  const at::Tensor& buffer() const { return buffer_; }
  /// One view of `buffer()` per parameter, shaped like the parameter.
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  /// The parameters' names (as in Module::named_parameters()).
  const std::vector<std::string>& names() const { return names_; }
  /// The data-parallel group.
  const Group& group() const { return group_; }
  /// What the sum must still be divided by (1 unless a 16-bit reduction
  /// splits the average around the sum).
  double post_divide() const { return post_divide_; }

 private:
  size_t index_;
  size_t count_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<std::string> names_;
  Group group_;
  double post_divide_ = 1;
};

/// What a hook returns: the collective it started (may be empty) and what to
/// do once that collective has finished.
///
/// DistributedDataParallel waits on `pending` and then runs `then` at the end
/// of backward, bucket by bucket in order, on every rank. `then` may start and
/// wait on further collectives (all ranks run the same `then`s in the same
/// order), and must leave the summed gradients in the bucket's buffer.
/// Hooks reach the wire through commgrad::ops::raw, so their collectives get
/// the debug check, the error context and the transport's fast paths.
///
/// Example (sum a float64 copy, write it back when done):
///   auto wide = bucket.buffer().to(at::kDouble);
///   auto buffer = bucket.buffer();
///   return commgrad::dp::CommWork{commgrad::ops::raw::all_reduce_(wide, {}, bucket.group()),
///                                 [buffer, wide] { buffer.copy_(wide); }};
struct CommWork {
  /// The raw collective in flight; empty when the hook finished synchronously.
  ops::raw::Pending pending;
  /// Runs after `pending` completes (optional), e.g. decompression.
  std::function<void()> then;
};

/// A communication hook: called once per bucket and backward, as soon as the
/// bucket's gradients are all ready; starts summing `bucket.buffer()` over
/// `bucket.group()` and returns without waiting.
///
/// Example (a hook that counts buckets, then all-reduces as usual):
///   auto plain = commgrad::allreduce_hook();
///   ddp.register_comm_hook([&](commgrad::GradBucket& b) { ++calls; return plain(b); });
using CommHook = std::function<CommWork(GradBucket& bucket)>;

/// The default: one in-place SUM all-reduce of the bucket buffer
/// (ops::raw::all_reduce_, which reduces float16/bfloat16 buckets in float32
/// where the transport cannot accumulate them in float32 itself).
///
/// Example:
///   ddp.register_comm_hook(commgrad::dp::allreduce_hook());
CommHook allreduce_hook();

/// Compresses the bucket to float16 for the wire (half the bytes of fp32),
/// all-reduces it and writes the result back in the bucket's dtype. Large
/// values can overflow fp16 (max 65504): DDP divides before the sum when it
/// averages, as PyTorch's fp16_compress_hook does. On a transport that
/// cannot accumulate 16-bit types in float32 (Gloo) the sum still travels
/// as float32 (ops/raw.h), so there it saves no bytes, only keeps the
/// rounding of the compressed hook.
///
/// Example:
///   ddp.register_comm_hook(commgrad::dp::fp16_compress_hook());
CommHook fp16_compress_hook();

/// Compresses the bucket to bfloat16 for the wire (fp32's range, 8 bits of
/// mantissa); the same as fp16_compress_hook otherwise.
///
/// Example:
///   ddp.register_comm_hook(commgrad::dp::bf16_compress_hook());
CommHook bf16_compress_hook();

}  // namespace commgrad::dp

namespace commgrad {
// The names before the dp namespace existed.
using dp::allreduce_hook;
using dp::bf16_compress_hook;
using dp::CommHook;
using dp::CommWork;
using dp::fp16_compress_hook;
using dp::GradBucket;
}  // namespace commgrad
