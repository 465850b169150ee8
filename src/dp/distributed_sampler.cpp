// DistributedSampler: PyTorch's DistributedSampler, index for index.
//
// PyTorch (torch/utils/data/distributed.py) computes, for n samples over R
// replicas:
//   num_samples = ceil((n - R) / R)  with drop_last and n % R != 0,
//                 ceil(n / R)        otherwise;  total = num_samples * R
//   indices     = randperm(n, generator seeded with seed + epoch), or 0..n-1
//   padded      = indices + indices repeated, cut to total (not drop_last),
//                 or indices cut to total (drop_last)
//   rank r      = padded[r :: R]
// The permutation comes from torch::randperm with a CPU generator seeded the
// same way, so the order is PyTorch's (checked against torch 2.15's values
// in tests/dp/sampler_test.cpp).

#include "commgrad/dp/distributed_sampler.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/dist/process_group.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace commgrad::dp {
namespace {

constexpr const char* kOp = "DistributedSampler";

int64_t samples_per_rank(int64_t n, int64_t replicas, bool drop_last) {
  if (drop_last && n % replicas != 0) return (n - replicas + replicas - 1) / replicas;  // ceil((n - R) / R)
  return (n + replicas - 1) / replicas;
}

std::vector<int64_t> epoch_order(int64_t n, int64_t epoch, const DistributedSamplerOptions& options) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (!options.shuffle()) {
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
    return order;
  }
  auto generator = at::detail::createCPUGenerator(options.seed() + static_cast<uint64_t>(epoch));
  const auto perm = at::randperm(n, generator, at::TensorOptions().dtype(at::kLong)).contiguous();
  const auto* p = perm.data_ptr<int64_t>();
  std::copy(p, p + n, order.begin());
  return order;
}

Group sampler_group(const Group& given) {
  if (given.defined()) return given;
  return model_parallel_is_initialized() ? parallel_state().data_parallel_group() : commgrad::world();
}

}  // namespace

std::vector<int64_t> distributed_sampler_indices(int64_t dataset_size, int num_replicas, int rank, int64_t epoch,
                                                 const DistributedSamplerOptions& options) {
  TORCH_CHECK(dataset_size >= 0, "[commgrad] ", kOp, ": the dataset size must not be negative, got ", dataset_size);
  TORCH_CHECK(num_replicas >= 1 && rank >= 0 && rank < num_replicas, "[commgrad] ", kOp, ": rank ", rank,
              " is not in [0, ", num_replicas, ")");
  const int64_t per_rank = samples_per_rank(dataset_size, num_replicas, options.drop_last());
  const int64_t total = per_rank * num_replicas;
  std::vector<int64_t> mine;
  if (per_rank == 0) return mine;  // (per_rank > 0 implies a non-empty dataset)
  const auto order = epoch_order(dataset_size, epoch, options);
  mine.reserve(static_cast<size_t>(per_rank));
  // Position k of the padded list is order[k % n]: padding repeats the list
  // from its start, as many times as needed (PyTorch's two cases agree).
  for (int64_t k = rank; k < total; k += num_replicas) mine.push_back(order[static_cast<size_t>(k % dataset_size)]);
  return mine;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options)
    : options_(std::move(options)), dataset_size_(dataset_size) {
  const Group group = sampler_group(options_.group());
  check_member(kOp, group);
  options_.group(group);
  num_replicas_ = group.size();
  rank_ = group.rank();
  COMMGRAD_CHECK(dataset_size >= 0, kOp, group, "the dataset size must not be negative, got ", dataset_size);
  num_samples_ = samples_per_rank(dataset_size, num_replicas_, options_.drop_last());
}

std::vector<int64_t> DistributedSampler::indices() const {
  return distributed_sampler_indices(dataset_size_, num_replicas_, rank_, epoch_, options_);
}

}  // namespace commgrad::dp
