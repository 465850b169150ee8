#pragma once
// Communication hooks of DistributedDataParallel: how one bucket of
// gradients is summed over the data-parallel group (plain all-reduce, or
// compressed to fp16 / bf16 on the wire).

#include "commgrad/detail/torch_compat.h"
#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace commgrad {

/// One bucket of gradients, as a communication hook sees it.
///
/// `buffer()` is a flat, contiguous 1-D tensor holding the bucket's local
/// gradients back to back (in bucket order). When DistributedDataParallel
/// averages, the buffer is already divided by the group size, so a hook only
/// has to *sum* it over `group()` and leave the sum in `buffer()`.
///
/// Example (inside a hook):
///   std::vector<at::Tensor> io{bucket.buffer()};
///   return commgrad::CommWork{bucket.group().transport().allreduce(io), nullptr};
class GradBucket {
 public:
  GradBucket(size_t index, size_t count, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<std::string> names, Group group)
      : index_(index),
        count_(count),
        buffer_(std::move(buffer)),
        gradients_(std::move(gradients)),
        names_(std::move(names)),
        group_(std::move(group)) {}

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

 private:
  size_t index_;
  size_t count_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<std::string> names_;
  Group group_;
};

/// What a hook returns: the collective it started (may be null) and what to
/// do once that collective has finished.
///
/// DistributedDataParallel waits on `work` and then runs `then` at the end of
/// backward, bucket by bucket in order, on every rank. `then` may start and
/// wait on further collectives (all ranks run the same `then`s in the same
/// order), and must leave the summed gradients in the bucket's buffer.
///
/// Example (sum a float64 copy, write it back when done):
///   auto wide = bucket.buffer().to(at::kDouble);
///   std::vector<at::Tensor> io{wide};
///   auto buffer = bucket.buffer();
///   return commgrad::CommWork{bucket.group().transport().allreduce(io), [buffer, wide] { buffer.copy_(wide); }};
struct CommWork {
  /// The transport's handle of the collective in flight; null when the hook
  /// finished synchronously.
  detail::WorkPtr work;
  /// Runs after `work` completes (optional), e.g. decompression.
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

/// The default: one in-place SUM all-reduce of the bucket buffer.
/// On transports without bfloat16 all-reduce (Gloo in LibTorch 1.13), bf16
/// buckets are summed as bf16_compress_hook() does.
///
/// Example:
///   ddp.register_comm_hook(commgrad::allreduce_hook());
CommHook allreduce_hook();

/// Compresses the bucket to float16 for the wire (half the bytes of fp32),
/// all-reduces it and writes the result back in the bucket's dtype. Large
/// values can overflow fp16 (max 65504): DDP divides before the sum when it
/// averages, as PyTorch's fp16_compress_hook does.
///
/// Example:
///   ddp.register_comm_hook(commgrad::fp16_compress_hook());
CommHook fp16_compress_hook();

/// Compresses the bucket to bfloat16 for the wire (fp32's range, 8 bits of
/// mantissa). Where the transport all-reduces bf16 (NCCL, shm) that is one
/// all-reduce; on Gloo, which cannot, it is a reduce-scatter built from
/// all-to-all (each rank sums its chunk in fp32) followed by an all-gather:
/// the same bytes per rank as a ring all-reduce of bf16.
///
/// Example:
///   ddp.register_comm_hook(commgrad::bf16_compress_hook());
CommHook bf16_compress_hook();

namespace detail {
/// Sums a flat bf16 tensor over `group` in place with all-to-all + all-gather
/// (for transports without bf16 all-reduce). The returned work is the
/// all-to-all; `then` finishes the job.
CommWork sum_bfloat16_by_alltoall(const at::Tensor& flat, const Group& group);
}  // namespace detail

}  // namespace commgrad
