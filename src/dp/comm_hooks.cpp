// Communication hooks of DistributedDataParallel.
//
// Each hook sums one bucket's flat buffer over the group and leaves the sum
// there; DDP has already divided the buffer by the group size when it
// averages. allreduce_hook is one asynchronous SUM all-reduce.
// fp16_compress_hook and bf16_compress_hook convert the bucket to 16 bits,
// sum that, and convert back in their completion step.
//
// Gloo in LibTorch 1.13 cannot all-reduce bfloat16. There the sum is built
// from what it can do: the buffer is padded to n equal chunks, the chunks
// are exchanged with one all-to-all (bf16 moved as raw 16-bit words, viewed
// as float16, so Gloo does no arithmetic on them), each rank adds the n
// copies of its own chunk in fp32 and rounds once to bf16, and an all-gather
// of the summed chunks rebuilds the buffer. Each rank sends and receives
// 2(n-1)/n of the bf16 buffer, as a ring all-reduce would.
//
// A group of one rank needs no communication; the hooks then do nothing.

#include "commgrad/dp/comm_hooks.h"

#include <ATen/ATen.h>

namespace commgrad {
namespace {

// NCCL and commgrad's shm backend reduce bfloat16; Gloo (1.13) does not.
bool transport_sums_bfloat16(const Group& group, const at::Tensor& flat) {
  const std::string& name = flat.is_cuda() ? group.cuda_backend_name() : group.backend_name();
  return name == "nccl" || name == "shm";
}

detail::WorkPtr all_reduce_sum(const at::Tensor& flat, const Group& group) {
  std::vector<at::Tensor> tensors{flat};
  return group.transport(flat.device().type()).allreduce(tensors);
}

// Sums `flat` (any dtype the transport handles, or bf16) in place.
CommWork sum_in_place(const at::Tensor& flat, const Group& group) {
  if (flat.scalar_type() == at::kBFloat16 && !transport_sums_bfloat16(group, flat)) {
    return detail::sum_bfloat16_by_alltoall(flat, group);
  }
  return CommWork{all_reduce_sum(flat, group), nullptr};
}

// Sums `bucket` through a copy in `wire_dtype`, written back when done.
CommWork sum_compressed(GradBucket& bucket, at::ScalarType wire_dtype) {
  const auto& buffer = bucket.buffer();
  if (bucket.group().size() == 1) return {};
  if (buffer.scalar_type() == wire_dtype) return sum_in_place(buffer, bucket.group());
  auto wire = buffer.to(wire_dtype);
  CommWork inner = sum_in_place(wire, bucket.group());
  auto inner_then = std::move(inner.then);
  return CommWork{std::move(inner.work), [buffer, wire, inner_then] {
                    if (inner_then) inner_then();
                    buffer.copy_(wire);
                  }};
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

namespace detail {

CommWork sum_bfloat16_by_alltoall(const at::Tensor& flat, const Group& group) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous() && flat.scalar_type() == at::kBFloat16,
              "[commgrad] sum_bfloat16_by_alltoall ", group.describe(), ": expected a flat contiguous bfloat16 "
              "tensor, got ", flat.scalar_type(), " ", flat.sizes());
  const int64_t n = group.size();
  const int64_t numel = flat.numel();
  if (n == 1 || numel == 0) return {};
  const int64_t chunk = (numel + n - 1) / n;
  auto send = at::zeros({n * chunk}, flat.options());
  send.narrow(0, 0, numel).copy_(flat);
  auto received = at::empty_like(send);
  // Raw 16-bit words: Gloo moves float16 but has no bfloat16.
  auto send_words = send.view(at::kHalf);
  auto received_words = received.view(at::kHalf);
  std::vector<int64_t> equal_splits;
  auto work = group.transport(flat.device().type()).alltoall_base(received_words, send_words, equal_splits, equal_splits);
  auto finish = [flat, send, received, n, chunk, numel, group] {
    // received[r] is rank r's copy of this rank's chunk.
    auto mine = received.view({n, chunk}).to(at::kFloat).sum(0).to(at::kBFloat16);
    std::vector<at::Tensor> in{mine.view(at::kHalf)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int64_t r = 0; r < n; ++r) out[0].push_back(at::empty({chunk}, flat.options().dtype(at::kHalf)));
    group.transport(flat.device().type()).allgather(out, in)->wait();
    flat.copy_(at::cat(out[0]).view(at::kBFloat16).narrow(0, 0, numel));
  };
  return CommWork{std::move(work), std::move(finish)};
}

}  // namespace detail
}  // namespace commgrad
