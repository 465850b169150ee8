// Wiring checks: the groups a module's partitioned parameters are split over,
// compared with the data-parallel group and the norm's tensor-parallel group
// a wrapper was given (see the header). They read the ShardSpecs only (no
// communication) and run once, when a wrapper is constructed.

#include "commgrad/tp/wiring_checks.h"

#include "commgrad/dist/check.h"
#include "commgrad/tp/attention.h"
#include "commgrad/tp/sharding.h"

#include <torch/nn/module.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

namespace commgrad::tp {
namespace {

std::string ranks_of(const Group& g) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < g.ranks().size(); ++i) out << (i ? ", " : "") << g.ranks()[i];
  out << ']';
  return out.str();
}

// The first partitioned parameter split over more than one rank, and its
// group; (empty, undefined) when there is none.
std::pair<std::string, Group> first_partitioned(const torch::nn::Module& module) {
  for (const auto& item : shard_specs(module)) {
    const ParameterShard& s = item.value();
    if (s.spec.is_partitioned() && s.group.defined() && s.group.size() > 1) return {item.key(), s.group};
  }
  return {"", Group()};
}

// The first attention in `module` that attends across a context-parallel
// group of more than one rank and has a parameter not in `ignored`, and
// that group; (empty, undefined) when none.
std::pair<std::string, Group> first_context_parallel(const torch::nn::Module& module,
                                                     const std::vector<std::string>& ignored) {
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const auto* attention = dynamic_cast<const ParallelSelfAttentionImpl*>(item.value().get());
    if (attention == nullptr || !attention->context_parallel()) continue;
    for (const auto& p : attention->named_parameters()) {
      const std::string name = item.key().empty() ? p.key() : item.key() + "." + p.key();
      if (std::find(ignored.begin(), ignored.end(), name) == ignored.end()) {
        return {item.key(), attention->options.context_parallel()->group()};
      }
    }
  }
  return {"", Group()};
}

}  // namespace

Group partitioned_parameters_group(const torch::nn::Module& module, const char* op) {
  const auto [first, group] = first_partitioned(module);
  if (!group.defined()) return group;
  for (const auto& item : shard_specs(module)) {
    const ParameterShard& s = item.value();
    if (!s.spec.is_partitioned() || !s.group.defined() || s.group.size() == 1) continue;
    COMMGRAD_CHECK(s.group.ranks() == group.ranks(), op, group, "parameter '", first, "' is split over group '",
                   group.name(), "' (ranks ", ranks_of(group), ") and '", item.key(), "' over '", s.group.name(),
                   "' (ranks ", ranks_of(s.group),
                   "); one tensor-parallel group per module: build its layers with the same group");
  }
  return group;
}

void check_data_parallel_group(const torch::nn::Module& module, const Group& data_parallel_group, const char* op,
                               const char* what) {
  if (!data_parallel_group.defined() || data_parallel_group.size() == 1) return;
  const auto [name, tp] = first_partitioned(module);
  if (!tp.defined() || !tp.is_member()) return;
  const auto& dp_ranks = data_parallel_group.ranks();
  std::vector<int> shared;
  for (int r : tp.ranks()) {
    if (std::find(dp_ranks.begin(), dp_ranks.end(), r) != dp_ranks.end()) shared.push_back(r);
  }
  COMMGRAD_CHECK(shared.size() < 2, op, data_parallel_group, "the data-parallel group '", data_parallel_group.name(),
                 "' (ranks ", ranks_of(data_parallel_group), ") holds ranks ", shared[0], " and ", shared[1],
                 " of tensor-parallel group '", tp.name(), "' (ranks ", ranks_of(tp), "), over which parameter '", name,
                 "' is split: it would average different shards. Pass the data-parallel group of the layout to ", what,
                 " (ParallelState::data_context_parallel_group(), which is the data-parallel group without context "
                 "parallelism; or no group once the layout is installed with initialize_model_parallel() or "
                 "ScopedParallelState)");
}

void check_context_parallel_replicas(const torch::nn::Module& module, const Group& data_parallel_group, const char* op,
                                     const char* what, const std::vector<std::string>& ignored) {
  const auto [name, cp] = first_context_parallel(module, ignored);
  if (!cp.defined() || !cp.is_member()) return;
  const Group given = data_parallel_group.defined() ? data_parallel_group : self_group();
  const auto& ranks = given.ranks();
  for (int r : cp.ranks()) {
    COMMGRAD_CHECK(std::find(ranks.begin(), ranks.end(), r) != ranks.end(), op, given, "'", name,
                   "' attends across the context-parallel group '", cp.name(), "' (ranks ", ranks_of(cp),
                   "): each of its ranks holds part of every sequence, so the gradients must be averaged over the "
                   "data x context group, which holds them all; the group given, '",
                   given.name(), "' (ranks ", ranks_of(given), "), does not hold rank ", r,
                   ", and the ranks' parameters would drift apart. Pass ",
                   "ParallelState::data_context_parallel_group() to ", what,
                   " (or no group once the layout is installed with initialize_model_parallel() or "
                   "ScopedParallelState)");
  }
}

Group tensor_parallel_group_for_norm(const torch::nn::Module& module, const Group& given, const char* op) {
  const Group split = partitioned_parameters_group(module, op);
  if (!split.defined()) return given;
  if (!given.defined()) return split;
  COMMGRAD_CHECK(given.ranks() == split.ranks(), op, given, "the tensor-parallel group for the norm, '", given.name(),
                 "' (ranks ", ranks_of(given),
                 "), is not the group the module's partitioned parameters are split "
                 "over, '",
                 split.name(), "' (ranks ", ranks_of(split),
                 "): the norm would miss the other ranks' shards. Pass that group (or none: it is taken from the "
                 "module)");
  return given;
}

}  // namespace commgrad::tp
