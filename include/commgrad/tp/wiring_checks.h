#pragma once
// Checks that catch wrong wiring of tensor-parallel modules into the layers
// that reduce over other groups (DistributedDataParallel, ZeroOptimizer,
// fully_shard, the global norm for clipping), at construction and on every
// rank that can see the mistake, with errors that say what to pass.
//
// Two mistakes train silently wrong without them:
// - a data-parallel group that holds two ranks of one tensor-parallel group
//   (the world of a TP = 2 x DP = 2 job, say): the wrapper broadcasts one TP
//   rank's shards over the other's and averages gradients of different
//   shards;
// - a global norm without the tensor-parallel group: each TP rank clips by
//   the norm of its own shards, the factors differ between TP ranks and the
//   TP-replicated parameters drift apart.
// The groups a module's partitioned parameters are split over are read from
// its ShardSpecs (tp/sharding.h), where the layers state them.

#include "commgrad/dist/group.h"

#include <string>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace commgrad::tp {

/// The tensor-parallel group `module`'s partitioned parameters are split
/// over, or an undefined group when none is split over more than one rank.
/// Errors (naming `op`) when they are split over groups of different ranks.
///
/// Example:
///   Group tp = tp::partitioned_parameters_group(*model, "my_trainer");
Group partitioned_parameters_group(const torch::nn::Module& module, const char* op);

/// Errors when `data_parallel_group` holds this rank and another rank of the
/// tensor-parallel group over which one of `module`'s parameters is split:
/// the error names the parameter, the two groups and the group to pass
/// (the layout's data-parallel group). `what` names the option that took
/// the group ("DistributedDataParallelOptions(group)"). Local: no
/// communication; every rank of the data-parallel group whose TP peer is in
/// it fails (in a layout's rank order, every rank of a wrong group).
///
/// Example:
///   tp::check_data_parallel_group(*model, dp_group, "my_trainer", "MyOptions(group)");
void check_data_parallel_group(const torch::nn::Module& module, const Group& data_parallel_group, const char* op,
                               const char* what);

/// Errors when `module` attends across a context-parallel group (a
/// ParallelSelfAttention with context_parallel()) whose ranks are not all in
/// `data_parallel_group` (undefined: this rank alone), unless the reducer
/// leaves its parameters alone (`ignored`, named_parameters() names: an
/// expert optimizer's dense parameters): each CP rank holds
/// part of every sequence, so a reducer must average over data x context
/// (ParallelState::data_context_parallel_group()), or the CP ranks'
/// parameters drift apart silently. DDP, ZeroOptimizer and fully_shard
/// (without a replicate group) run it. Local: no communication.
///
/// Example:
///   tp::check_context_parallel_replicas(*model, dp_group, "my_trainer", "MyOptions(group)");
void check_context_parallel_replicas(const torch::nn::Module& module, const Group& data_parallel_group, const char* op,
                                     const char* what, const std::vector<std::string>& ignored = {});

/// The tensor-parallel group of a global gradient norm over `module`:
/// `given` when defined and `module` holds no partitioned parameter, or
/// when its ranks are those of the partitioned parameters' group (else an
/// error naming both); the partitioned parameters' group when `given` is
/// undefined; undefined when neither is.
///
/// Example:
///   const Group tp = tp::tensor_parallel_group_for_norm(*model, options.tensor_parallel_group(), "my_clip");
Group tensor_parallel_group_for_norm(const torch::nn::Module& module, const Group& given, const char* op);

}  // namespace commgrad::tp
