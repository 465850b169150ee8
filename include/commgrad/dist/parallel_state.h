#pragma once
// The parallel layout: tensor-, context-, data- and pipeline-parallel groups
// in one rank order (Megatron's parallel_state), and the expert-parallel
// groups cut from the data x context ranks. It needs only new_group, and every
// layer that reduces over a group (tp, pp, dp, fsdp, optim) asks it for its
// groups.
//
// A world of W = tp * cp * dp * pp ranks is cut into groups in Megatron's
// rank order tp, cp, dp, pp (tp varies fastest): the ranks of a tensor-
// parallel group are adjacent (TP traffic, the heaviest, stays inside a host),
// context-parallel groups stride by tp, data-parallel groups by tp * cp, and
// pipeline groups by W / pp. With W = 8, tp = 2, pp = 2:
//
//   tensor  [0, 1] [2, 3] [4, 5] [6, 7]
//   data    [0, 2] [1, 3] [4, 6] [5, 7]
//   pipe    [0, 4] [1, 5] [2, 6] [3, 7]
//
// With W = 8, tp = 2, cp = 2 (dp = 2):
//
//   tensor        [0, 1] [2, 3] [4, 5] [6, 7]
//   context       [0, 2] [1, 3] [4, 6] [5, 7]
//   data          [0, 4] [1, 5] [2, 6] [3, 7]
//   data-context  [0, 2, 4, 6] [1, 3, 5, 7]
//
// Parameters are replicated over the data-context group (the context ranks
// hold different tokens of the same sequences, as data ranks hold different
// sequences), so gradients are averaged over it: it is what DDP, ZeRO and
// fully_shard take by default. Experts (Megatron's expert layout, with the
// expert tensor-parallel size equal to tp) split each data-context group
// into expert-parallel groups of ep consecutive members and expert-data-
// parallel groups of members ep apart; with ep = 2 above:
//
//   expert        [0, 2] [4, 6] [1, 3] [5, 7]
//   expert-data   [0, 4] [2, 6] [1, 5] [3, 7]
//
// The groups live in a ParallelState value. initialize_model_parallel() builds
// one from the world and installs it as the current state, which layers use
// when they are not given a group; tests and programs that need several
// states (or one per thread) build them with make_model_parallel() and pass
// the groups explicitly or install them with ScopedParallelState. There is no
// hidden global that a test cannot replace.

#include "commgrad/dist/group.h"

#include <torch/arg.h>

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
  /// This rank's data-parallel group ("dp<k>"): the ranks that hold other
  /// sequences of the batch (context ranks excluded).
  const Group& data_parallel_group() const;
  /// This rank's context-parallel group ("cp<k>"): the ranks that hold the
  /// other parts of this rank's sequences. A group of one when cp = 1.
  const Group& context_parallel_group() const;
  /// Data x context ("dpcp<k>"): the ranks over which every dense parameter
  /// is replicated and its gradient averaged. The data-parallel group itself
  /// when cp = 1.
  const Group& data_context_parallel_group() const;
  /// This rank's expert-parallel group ("ep<k>"): ep consecutive members of
  /// the data-context group, which split the experts between them. A group
  /// of one when ep = 1.
  const Group& expert_parallel_group() const;
  /// This rank's expert-data-parallel group ("edp<k>"): the members of the
  /// data-context group that hold the same experts (ep apart), over which
  /// expert gradients are averaged. The data-context group when ep = 1.
  const Group& expert_data_parallel_group() const;
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
  int context_parallel_rank() const { return context_parallel_group().rank(); }
  int context_parallel_size() const { return context_parallel_group().size(); }
  int expert_parallel_rank() const { return expert_parallel_group().rank(); }
  int expert_parallel_size() const { return expert_parallel_group().size(); }

  /// "tp 1/2 (shm) pp 0/1 (shm) dp 0/2 (gloo) (world 4, hierarchical)":
  /// each group's rank, size and transport (cp and ep too when above 1).
  std::string describe() const;

  bool operator==(const ParallelState& other) const { return data_ == other.data_; }
  bool operator!=(const ParallelState& other) const { return data_ != other.data_; }

 private:
  const detail::ParallelStateData& checked() const;
  std::shared_ptr<const detail::ParallelStateData> data_;
};

/// The sizes of a layout; the data-parallel size is what is left of the
/// world: W / (tp * cp * pp).
struct ModelParallelOptions {
  ModelParallelOptions(int tensor_parallel_size = 1, int pipeline_parallel_size = 1)
      : tensor_parallel_size_(tensor_parallel_size), pipeline_parallel_size_(pipeline_parallel_size) {}
  TORCH_ARG(int, tensor_parallel_size);
  TORCH_ARG(int, pipeline_parallel_size);
  /// Ranks that split each sequence (context parallelism).
  TORCH_ARG(int, context_parallel_size) = 1;
  /// Ranks that split the experts; must divide dp * cp.
  TORCH_ARG(int, expert_parallel_size) = 1;
};

/// Builds the groups of a tp x cp x dp x pp layout over `world` (empty:
/// commgrad::world()) without installing them. Collective: every rank of the
/// world calls it with the same sizes. Errors (before any group is created)
/// when a size is below 1, W is not divisible by tp * cp * pp, or ep does not
/// divide dp * cp.
///
/// Example:
///   auto state = make_model_parallel(ModelParallelOptions(2).context_parallel_size(2), world);
ParallelState make_model_parallel(const ModelParallelOptions& options, const Group& world = Group());
/// make_model_parallel(ModelParallelOptions(tp, pp), world).
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
ParallelState initialize_model_parallel(const ModelParallelOptions& options);
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
Group context_parallel_group();
Group data_context_parallel_group();
Group expert_parallel_group();
Group expert_data_parallel_group();

/// The groups wrappers use when they are given none (an explicit group
/// always wins): the current layout's data x context group (the data-
/// parallel group when cp = 1), or the world when no layout is current
/// (DistributedDataParallel, ZeroOptimizer, fully_shard).
Group default_data_parallel_group();
/// The current layout's expert-data-parallel group (expert parameters'
/// gradients are averaged over it), or default_data_parallel_group() when no
/// layout is current.
Group default_expert_data_parallel_group();
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
