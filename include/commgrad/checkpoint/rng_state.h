#pragma once
// The tensor-parallel RNG streams (tp::RngTracker) in a checkpoint.
//
// What is saved: the default (replicated) stream once, as "rng/default"
// (rank 0's: model_parallel_manual_seed() makes it identical on every rank,
// and every rank draws from it alike); every other stream once per TP rank
// t, as "rng/<stream>/tp<t>" (identical on the data-parallel replicas of
// that TP rank, written by the lowest of them).
//
// The rule at load:
//   - unchanged layout: every stream is restored exactly;
//   - another TP size: the default stream is restored on every rank; the
//     stream of TP rank t is restored where the save had a TP rank t, and
//     left as it is (as seeded) elsewhere: the new ranks keep their own
//     seeds, so their streams still differ from every other rank's.
// The per-TP-rank pieces are saved with required = false, so strict loads
// under a smaller TP size do not complain about the streams nobody loads.

#include "commgrad/checkpoint/load.h"
#include "commgrad/checkpoint/tensor_piece.h"
#include "commgrad/dist/group.h"
#include "commgrad/tp/random.h"

#include <string>
#include <vector>

namespace commgrad::checkpoint {

/// The pieces of `tracker`'s streams (copies of their current states) for
/// TP rank tp_group.rank(). For save() as they are; for load(), pass the
/// same list and then call restore_rng().
///
/// Example:
///   auto rng = checkpoint::rng_pieces(tp::rng_tracker(), state.tensor_parallel_group());
///   checkpoint::save("ckpt", step, rng);
///   ...
///   auto rng = checkpoint::rng_pieces(tp::rng_tracker(), state.tensor_parallel_group());
///   auto result = checkpoint::load("ckpt", rng);
///   checkpoint::restore_rng(tp::rng_tracker(), rng, result);
std::vector<TensorPiece> rng_pieces(const tp::RngTracker& tracker, const Group& tp_group,
                                    const std::string& prefix = "rng/");

/// Sets `tracker`'s streams to the states load() wrote into `pieces` (from
/// rng_pieces() with the same prefix), leaving those the checkpoint lacked
/// (result.skipped) as they are. Returns the names of the restored streams
/// (tp::kDefaultRng for the default one).
std::vector<std::string> restore_rng(tp::RngTracker tracker, const std::vector<TensorPiece>& pieces,
                                     const LoadResult& result, const std::string& prefix = "rng/");

}  // namespace commgrad::checkpoint
