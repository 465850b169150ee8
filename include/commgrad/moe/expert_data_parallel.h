#pragma once
// Which group reduces which gradient when a model holds experts.
//
// Dense parameters (the router, attention, norms, embeddings) are replicated
// over the data x context group and averaged over it, as without experts.
// Expert parameters are replicated over the expert-data-parallel group only
// (the ranks ep apart that hold the same experts). After backward an
// expert's gradient already holds the contributions of every rank of its
// expert-parallel group (the all-to-all's backward brought them), so it is
// SUMMED over the expert-data group and divided by the data x context size
// N = ep * edp: the same divisor as the dense gradients, so both are the
// gradient of the mean of the N ranks' losses, which is the one-rank
// gradient of the mean over the whole batch. Averaging over the expert-data
// group alone (dividing by edp) would leave expert gradients ep times too
// large (Megatron PR#5956); reducing them over the data x context group
// would average different experts together (Megatron PR#1622).
//
// The simplest form that keeps DDP's and ZeRO's bucketing and overlap: two
// wrappers over the same module, one over the dense parameters (the expert
// ones ignored) and one over the expert parameters (the dense ones ignored,
// average_divisor = N). Both are built from the options below.
//
// The global gradient norm counts every parameter once: the dense squares on
// one rank (after the reduction they are the same on every rank of the data
// group) plus the expert squares summed over the expert-parallel group (each
// rank holds other experts).
//
// fully_shard has the same two groups: each moe::Experts a unit sharded over
// the expert-data group (summed there, divided by N: average_divisor), the
// modules around them units over the data x context group. The outermost
// unit's clip_grad_norm_ sums every unit's shard squares over the data x
// context group, which is the expert-data group times the expert-parallel
// group: each dense parameter and each expert once.

#include "commgrad/dist/group.h"
#include "commgrad/dp/distributed_data_parallel.h"
#include "commgrad/fsdp/fully_shard.h"

#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace commgrad::moe {

/// The names (named_parameters()) of the parameters of every moe::Experts
/// inside `module`.
std::vector<std::string> expert_parameter_names(const torch::nn::Module& module);
/// The names of all the other parameters.
std::vector<std::string> dense_parameter_names(const torch::nn::Module& module);

/// `base` over `data_group` (the data x context group) with the expert
/// parameters ignored.
///
/// Example:
///   auto state = commgrad::make_model_parallel(commgrad::ModelParallelOptions().expert_parallel_size(2));
///   dp::DistributedDataParallel dense(model, moe::dense_ddp_options(*model, state.data_context_parallel_group()));
///   dp::DistributedDataParallel experts(model, moe::expert_ddp_options(*model, state.data_context_parallel_group(),
///                                                                      state.expert_data_parallel_group()));
dp::DistributedDataParallelOptions dense_ddp_options(const torch::nn::Module& module, const Group& data_group,
                                                     dp::DistributedDataParallelOptions base = {});

/// `base` over `expert_data_group`, summed and divided by the size of
/// `data_group` (average_divisor), with the dense parameters ignored and no
/// buffer broadcast (the dense wrapper does it).
dp::DistributedDataParallelOptions expert_ddp_options(const torch::nn::Module& module, const Group& data_group,
                                                      const Group& expert_data_group,
                                                      dp::DistributedDataParallelOptions base = {});

/// fully_shard() of every moe::Experts inside `module` over
/// `expert_data_group`, summed there and divided by the size of
/// `options.group()` (the data x context group; undefined: the layout's
/// data-parallel group): expert_ddp_options' rule for fully_shard. Call it
/// before fully_shard of the modules that hold the experts (bottom-up, over
/// options.group()); the outermost handle's clip_grad_norm_ counts every
/// expert once. Collective over the expert-data group. Returns the experts'
/// handles, in module order. HSDP (options.replicate_group()) is an error.
///
/// Example:
///   const auto& data = state.data_context_parallel_group();
///   moe::fully_shard_experts(*model, fsdp::FullyShardOptions(data), state.expert_data_parallel_group());
///   auto sharded = fsdp::fully_shard(model, data);
///   // forward through fsdp::call(model, x), backward, then
///   sharded.clip_grad_norm_(1.0);
std::vector<fsdp::FullyShardedModule> fully_shard_experts(const torch::nn::Module& module,
                                                          fsdp::FullyShardOptions options,
                                                          const Group& expert_data_group);

/// Clips the reduced gradients of `module` to the global L2 norm
/// `max_norm` (0: only measure) and returns the norm before clipping: dense
/// squares counted once, expert squares summed over `expert_parallel_group`
/// (see the file comment). Collective over that group. For modules without
/// tensor- or pipeline-parallel splits.
///
/// Example:
///   loss.backward();                       // both wrappers reduced
///   moe::clip_grad_norm_(*model, 1.0, state.expert_parallel_group());
double clip_grad_norm_(const torch::nn::Module& module, double max_norm, const Group& expert_parallel_group);

}  // namespace commgrad::moe
