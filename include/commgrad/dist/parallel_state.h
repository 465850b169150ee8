#pragma once
// The parallel layout: tensor-, pipeline- and data-parallel groups in one
// rank order (Megatron's parallel_state). It needs only new_group, and every
// layer that reduces over a group (tp, pp, dp, optim) asks it for its groups.
//
// A world of W = tp * pp * dp ranks is cut into groups in Megatron's rank
// order: the tp ranks of a tensor-parallel group are adjacent (so TP traffic,
// the heaviest, stays inside a host), data-parallel groups stride by tp
// inside a pipeline stage, and pipeline groups stride by W / pp. With W = 8,
// tp = 2, pp = 2:
//
//   tensor  [0, 1] [2, 3] [4, 5] [6, 7]
//   data    [0, 2] [1, 3] [4, 6] [5, 7]
//   pipe    [0, 4] [1, 5] [2, 6] [3, 7]
//
// The groups live in a ParallelState value. initialize_model_parallel() builds
// one from the world and installs it as the current state, which layers use
// when they are not given a group; tests and programs that need several
// states (or one per thread) build them with make_model_parallel() and pass
// the groups explicitly or install them with ScopedParallelState. There is no
// hidden global that a test cannot replace.

#include "commgrad/dist/group.h"

#include <memory>
#include <string>

namespace commgrad {

namespace detail {
struct ParallelStateData;  // src/dist/parallel_state.cpp
}  // namespace detail

/// The groups of one model-parallel layout, as seen from this rank. A cheap
/// handle: copies share the groups.
///
/// Example:
///   auto state = make_model_parallel(2);          // TP=2, PP=1, DP=W/2
///   auto fc = tp::ColumnParallelLinear(
///       tp::ColumnParallelLinearOptions(64, 256, state.tensor_parallel_group()));
class ParallelState {
 public:
  /// An empty state (defined() == false).
  ParallelState() = default;
  explicit ParallelState(std::shared_ptr<const detail::ParallelStateData> data) : data_(std::move(data)) {}

  /// True when this handle refers to built groups.
  bool defined() const { return data_ != nullptr; }

  /// The world the groups were cut from.
  const Group& world() const;
  /// This rank's tensor-parallel group ("tp<k>").
  const Group& tensor_parallel_group() const;
  /// This rank's pipeline-parallel group ("pp<k>").
  const Group& pipeline_parallel_group() const;
  /// This rank's data-parallel group ("dp<k>").
  const Group& data_parallel_group() const;
  /// The first and the last rank of this rank's pipeline group, which hold
  /// the tied input and output embeddings (Megatron's embedding group):
  /// their gradients are summed over it. The pipeline group itself when it
  /// has one or two ranks; undefined on the ranks of the middle stages.
  const Group& embedding_group() const;

  int tensor_parallel_rank() const { return tensor_parallel_group().rank(); }
  int tensor_parallel_size() const { return tensor_parallel_group().size(); }
  int pipeline_parallel_rank() const { return pipeline_parallel_group().rank(); }
  int pipeline_parallel_size() const { return pipeline_parallel_group().size(); }
  int data_parallel_rank() const { return data_parallel_group().rank(); }
  int data_parallel_size() const { return data_parallel_group().size(); }

  /// "tp 1/2 (shm) pp 0/1 (shm) dp 0/2 (gloo) (world 4, hierarchical)":
  /// each group's rank, size and transport.
  std::string describe() const;

  bool operator==(const ParallelState& other) const { return data_ == other.data_; }
  bool operator!=(const ParallelState& other) const { return data_ != other.data_; }

 private:
  const detail::ParallelStateData& checked() const;
  std::shared_ptr<const detail::ParallelStateData> data_;
};

/// Builds the groups of a tp x pp (x dp = W / (tp * pp)) layout over `world`
/// (empty: commgrad::world()) without installing them. Collective: every rank
/// of the world calls it with the same sizes. Errors (before any group is
/// created) when tp or pp is below 1 or W is not divisible by tp * pp.
///
/// Example:
///   auto state = make_model_parallel(4, 1, world);
ParallelState make_model_parallel(int tensor_parallel_size, int pipeline_parallel_size = 1,
                                  const Group& world = Group());

/// make_model_parallel() on commgrad::world(), installed as the current state
/// of that world (in one-rank-per-thread programs each thread's world gets
/// its own). Errors when a state is already installed for this world.
///
/// Example:
///   commgrad::init_process_group();
///   initialize_model_parallel(2);
///   auto g = tensor_parallel_group();
///   ...
///   destroy_model_parallel();
ParallelState initialize_model_parallel(int tensor_parallel_size, int pipeline_parallel_size = 1);

/// Uninstalls the current world's state (no-op when none). Groups stay alive
/// while ParallelState handles or layers still refer to them.
void destroy_model_parallel();

/// True when a state is current (installed for this world, or scoped).
bool model_parallel_is_initialized();

/// The current state: this thread's ScopedParallelState if any, else the one
/// installed for commgrad::world(). Errors when there is none.
ParallelState parallel_state();

/// Shortcuts for parallel_state().tensor_parallel_group() and friends.
Group tensor_parallel_group();
int tensor_parallel_rank();
int tensor_parallel_size();
Group pipeline_parallel_group();
Group data_parallel_group();
int data_parallel_rank();
int data_parallel_size();

/// The groups wrappers use when they are given none (an explicit group
/// always wins): the current layout's data-parallel group, or the world when
/// no layout is current (DistributedDataParallel, ZeroOptimizer).
Group default_data_parallel_group();
/// The current layout's tensor-parallel (pipeline-parallel) group when it
/// has more than one rank; undefined otherwise (ZeroOptimizer's global norm).
Group default_tensor_parallel_group();
Group default_pipeline_parallel_group();

/// A single-rank group that belongs to this process alone (no communication,
/// no collective call to create it; one per thread): the group of an unsplit
/// reference layer (TP = 1) built next to a parallel one, or of a one-rank
/// reference run.
///
/// Example:
///   auto reference = tp::ColumnParallelLinear(
///       tp::ColumnParallelLinearOptions(64, 256, commgrad::self_group()).seed(7));
Group self_group();

/// Makes `state` the current one for this thread while it lives.
///
/// Example:
///   ScopedParallelState scope(make_model_parallel(2, 1, world));
///   tp::ParallelMLP mlp(tp::ParallelMLPOptions(64, 256));   // uses the scoped TP group
class ScopedParallelState {
 public:
  explicit ScopedParallelState(ParallelState state);
  ~ScopedParallelState();
  ScopedParallelState(const ScopedParallelState&) = delete;
  ScopedParallelState& operator=(const ScopedParallelState&) = delete;

 private:
  ParallelState previous_;
};

}  // namespace commgrad
