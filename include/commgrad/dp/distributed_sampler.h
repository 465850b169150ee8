#pragma once
// DistributedSampler: which samples of a dataset each data-parallel rank
// reads in an epoch, exactly as PyTorch's
// torch.utils.data.distributed.DistributedSampler splits them.
//
// Every epoch the dataset's indices are shuffled by a generator seeded with
// seed + epoch (torch.randperm, so the order is PyTorch's for the same seed),
// the list is padded with its own first indices up to a multiple of the
// number of replicas (or its tail dropped, with drop_last), and rank r takes
// every num_replicas-th index from r. Each sample thus goes to exactly one
// rank per epoch (a padded one to two), and the split depends only on the
// data-parallel size and rank: the same at every tensor-, context- or
// pipeline-parallel layout with the same number of data-parallel ranks.
//
// Ranks of one tensor- or context-parallel group read the same samples, so
// the default group is the current layout's data-parallel group (context
// ranks excluded), or the world without a layout.

#include "commgrad/dist/group.h"

#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace commgrad::dp {

/// Options of DistributedSampler (PyTorch's arguments and defaults).
///
/// Example:
///   commgrad::dp::DistributedSamplerOptions().shuffle(true).seed(1234).drop_last(true)
struct DistributedSamplerOptions {
  /// `group` splits the samples; undefined: the current layout's data-
  /// parallel group, or the world when no layout is current.
  /* implicit */ DistributedSamplerOptions(Group group = Group()) : group_(std::move(group)) {}
  TORCH_ARG(Group, group);
  /// Shuffle the indices every epoch (seeded with seed + epoch).
  TORCH_ARG(bool, shuffle) = true;
  /// The same on every rank.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Drop the tail that does not split evenly instead of padding it with
  /// the first indices.
  TORCH_ARG(bool, drop_last) = false;
};

/// This rank's share of a dataset of `dataset_size` samples, per epoch.
///
/// Example:
///   commgrad::dp::DistributedSampler sampler(dataset.size().value());
///   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
///     sampler.set_epoch(epoch);
///     for (int64_t i : sampler.indices()) train_on(dataset.get(i));
///   }
class DistributedSampler {
 public:
  explicit DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options = {});

  /// Chooses the shuffle of the following indices() (PyTorch's set_epoch).
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  /// This rank's indices for the current epoch: num_samples() of them.
  std::vector<int64_t> indices() const;

  /// Samples per rank and epoch (PyTorch's len(sampler)).
  int64_t num_samples() const { return num_samples_; }
  /// num_samples() * num_replicas(): the padded (or cut) epoch.
  int64_t total_size() const { return num_samples_ * num_replicas_; }
  int num_replicas() const { return num_replicas_; }
  int rank() const { return rank_; }
  const DistributedSamplerOptions& options() const { return options_; }

 private:
  DistributedSamplerOptions options_;
  int64_t dataset_size_;
  int num_replicas_;
  int rank_;
  int64_t num_samples_;
  int64_t epoch_ = 0;
};

/// The indices rank `rank` of `num_replicas` reads in `epoch` (what
/// DistributedSampler::indices() returns, without a group).
std::vector<int64_t> distributed_sampler_indices(int64_t dataset_size, int num_replicas, int rank, int64_t epoch,
                                                 const DistributedSamplerOptions& options = {});

}  // namespace commgrad::dp
