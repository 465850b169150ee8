#pragma once
// Tensor-parallel-aware random streams (Megatron's CudaRNGStatesTracker and
// model_parallel_cuda_manual_seed, on CPU generators).
//
// Inside a tensor-parallel group some activations are replicated (every TP
// rank holds the same values) and some are split (each rank holds its own
// heads, columns or sequence chunk). Dropout must follow: a mask applied to a
// replicated activation must be identical on every TP rank, or the replicas
// drift apart; a mask applied to a split activation must differ between
// ranks, or every shard drops the same pattern. Both must be reproducible
// from one seed.
//
// An RngTracker holds named CPU generators. model_parallel_manual_seed(seed,
// tp_group) seeds its "default" (replicated) stream with `seed` on every TP
// rank and its kModelParallelRng stream with seed + 2718 + tp_rank. Random
// ops of commgrad layers (tp::dropout) draw from the tracker's current
// stream: the default one, or the forked one inside an RngFork scope.
//
// LibTorch's own random functions (torch::dropout, torch::randn without a
// generator) keep drawing from LibTorch's global generator, which one-rank-
// per-thread programs share between ranks; pass current_generator() to them
// explicitly when they must follow the tracker.
//
// Initialisation is separate: a layer built without `.seed()` draws its seed
// from LibTorch's default CPU generator, the same on every rank of its group
// (draw_seed(), resolve_seed() below), so torch::manual_seed() governs it as
// it governs torch::nn::Linear.

#include "commgrad/dist/group.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::tp {

/// Name of the stream that differs between tensor-parallel ranks
/// (Megatron's "model-parallel-rng").
inline constexpr const char* kModelParallelRng = "model-parallel";
/// Name under which get_states() reports the replicated default stream.
inline constexpr const char* kDefaultRng = "default";
/// Offset between the replicated seed and the tensor-parallel seed
/// (Megatron's 2718): tp seed = seed + kTensorParallelSeedOffset + tp_rank.
inline constexpr uint64_t kTensorParallelSeedOffset = 2718;

namespace detail {
struct RngTrackerState;  // src/tp/random.cpp
}  // namespace detail

class RngFork;

/// Generator states by stream name (kDefaultRng for the default stream), as
/// returned by RngTracker::get_states(); used to replay the same random draws,
/// e.g. when activations are recomputed.
using RngStates = std::map<std::string, at::Tensor>;

/// A set of named CPU random streams plus a default (replicated) stream.
/// A cheap handle: copies share the streams. Forks are per thread, so one
/// tracker may be used from several threads (each thread forks its own view).
///
/// Example:
///   tp::RngTracker tracker;
///   tp::model_parallel_manual_seed(1234, tp_group, tracker);
///   auto a = tp::dropout(x, 0.1, true, tracker);        // same mask on every TP rank
///   {
///     auto guard = tracker.fork();                       // kModelParallelRng
///     auto b = tp::dropout(shard, 0.1, true, tracker);   // a different mask per TP rank
///   }
class RngTracker {
 public:
  /// A tracker with only the default stream, seeded with LibTorch's default seed.
  RngTracker();

  /// Forgets every named stream and reseeds the default stream with LibTorch's
  /// default seed (Megatron's tracker.reset()).
  void reset();
  /// Reseeds the default (replicated) stream.
  void manual_seed(uint64_t seed);
  /// Adds the stream `name` seeded with `seed`. Errors when the name or the
  /// seed is already in use (two streams with one seed would be correlated).
  void add(const std::string& name, uint64_t seed);
  /// True when a stream `name` was added.
  bool has(const std::string& name) const;
  /// Names of the added streams (not the default one), sorted.
  std::vector<std::string> names() const;

  /// The default (replicated) stream's generator.
  at::Generator default_generator() const;
  /// The generator of stream `name` (error when it was not added).
  at::Generator generator(const std::string& name) const;
  /// What this thread draws from now: the innermost active fork's generator,
  /// else the default one.
  at::Generator current_generator() const;

  /// Makes stream `name` this thread's current stream until the returned
  /// guard is destroyed (Megatron's `with tracker.fork():`). Forks nest.
  [[nodiscard]] RngFork fork(const std::string& name = kModelParallelRng) const;

  /// Copies of every stream's state (the default one under kDefaultRng).
  RngStates get_states() const;
  /// Restores states from get_states(): each named stream must exist (the
  /// default one is optional in `states`).
  void set_states(const RngStates& states);

  bool operator==(const RngTracker& other) const { return state_ == other.state_; }
  bool operator!=(const RngTracker& other) const { return state_ != other.state_; }

 private:
  std::shared_ptr<detail::RngTrackerState> state_;
};

/// RAII scope returned by RngTracker::fork(): while it lives, this thread's
/// current stream of that tracker is the forked one. Movable, not copyable;
/// guards must be destroyed in reverse order of creation.
class RngFork {
 public:
  RngFork(RngFork&& other) noexcept;
  RngFork& operator=(RngFork&&) = delete;
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;
  ~RngFork();

 private:
  friend class RngTracker;
  RngFork(std::shared_ptr<detail::RngTrackerState> state, at::Generator generator);
  std::shared_ptr<detail::RngTrackerState> state_;  // null once moved from
};

/// This thread's tracker: the one installed by a ScopedRngTracker, else the
/// process's tracker. Layers that draw random numbers use it at forward time.
RngTracker rng_tracker();

/// Makes `tracker` this thread's rng_tracker() while it lives (for programs
/// and tests that run one rank per thread; see ScopedWorld).
///
/// Example:
///   tp::ScopedRngTracker scoped(tp::RngTracker{});
///   tp::model_parallel_manual_seed(7, tp_group);   // seeds this thread's tracker
class ScopedRngTracker {
 public:
  explicit ScopedRngTracker(RngTracker tracker);
  ~ScopedRngTracker();
  ScopedRngTracker(const ScopedRngTracker&) = delete;
  ScopedRngTracker& operator=(const ScopedRngTracker&) = delete;

 private:
  std::shared_ptr<RngTracker> previous_;
};

/// Seeds `tracker` from one seed (Megatron's model_parallel_cuda_manual_seed):
/// resets it, seeds the default stream with `seed` (identical on every TP
/// rank) and adds kModelParallelRng seeded with
/// seed + kTensorParallelSeedOffset + tp_group.rank(). Purely local: no
/// communication. The caller must be a member of `tp_group`.
///
/// Example:
///   tp::model_parallel_manual_seed(1234, commgrad::tensor_parallel_group());
void model_parallel_manual_seed(uint64_t seed, const Group& tp_group, RngTracker tracker = rng_tracker());

// ~~~ Initialisation seeds ~~~

/// One seed drawn from LibTorch's default CPU generator (under its mutex, as
/// LibTorch's own random functions draw): what a layer built without
/// `.seed()` initialises from, so that torch::manual_seed(s) makes it
/// reproducible and two such layers differ, as two torch::nn::Linear do.
/// Advances the default generator by one 64-bit draw. The single-rank
/// references (reference.h) use it directly.
uint64_t draw_seed();

/// The initialisation seed of a layer of tensor-parallel group `group`:
/// `seed` when given (no draw, no communication); otherwise draw_seed() on
/// every rank, so that every rank's default generator advances alike, and
/// then group rank 0's draw broadcast over `group` (skipped for a group of
/// one), so that all ranks build their shards of one full layer even when
/// their generators have drifted apart. Collective without an explicit seed:
/// every rank of `group` must call it, in the same order.
///
/// Example:
///   torch::manual_seed(1234);                                // on every rank
///   const uint64_t s = tp::resolve_seed(std::nullopt, tp_group);   // the same on every rank
uint64_t resolve_seed(const std::optional<uint64_t>& seed, const Group& group);

/// Inverted dropout whose mask comes from tracker.current_generator(): the
/// replicated stream normally, the forked one inside tracker.fork(). Returns
/// `x` itself when not training or p == 0; p == 1 gives zeros. The mask is
/// drawn in row-major order of x's shape, so strides do not change it.
/// Differentiable in x. Call it qualified (tp::dropout): unqualified, argument-
/// dependent lookup also finds at::dropout and the call is ambiguous.
///
/// Example:
///   auto guard = tp::rng_tracker().fork();
///   probs = tp::dropout(probs, 0.1, is_training());
at::Tensor dropout(const at::Tensor& x, double p, bool training, const RngTracker& tracker = rng_tracker());

}  // namespace commgrad::tp
