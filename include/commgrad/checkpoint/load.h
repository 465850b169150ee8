#pragma once
// checkpoint::load: fills this rank's pieces from a saved step, under any
// layout (resharding).
//
// Each destination piece is filled from every saved piece of the same name
// that overlaps it: the overlap of two N-d boxes is copied directly, and a
// saved flat range is first placed into a buffer shaped like its box (only
// the ranges that reach the destination are read). So a checkpoint saved at
// TP=2 x DP=2 loads at TP=4, at TP=1, or into ZeRO shards of another DP
// size, as long as the destination pieces describe where they sit in the
// global tensors (module_pieces() does for a model).
//
// Collective over `group`. Every shard entry read is checked against the
// crc32 the index records. load() reads everything into temporary buffers
// first and copies into the destinations only when every rank has read
// successfully: a failed load leaves every destination as it was, on every
// rank, and raises on every rank.

#include "commgrad/checkpoint/tensor_piece.h"
#include "commgrad/dist/group.h"

#include <nlohmann/json.hpp>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::checkpoint {

/// Options of load().
///
/// Example:
///   checkpoint::load("ckpt", pieces, checkpoint::LoadOptions().step(5).strict(false));
struct LoadOptions {
  /// The step to load; nullopt: the one root/latest names.
  TORCH_ARG(std::optional<int64_t>, step) = std::nullopt;
  /// Also fail when the checkpoint holds a required tensor that no rank
  /// loads (an index from another model; the error lists them), in the
  /// sections that are loaded: the part of a name up to its first '/'
  /// ("model/"), so loading only "model/" pieces of a training checkpoint
  /// (weights for evaluation) ignores "optim/" and "rng/". Destination
  /// pieces the checkpoint lacks fail either way, unless marked
  /// required = false.
  TORCH_ARG(bool, strict) = true;
};

/// What load() found.
struct LoadResult {
  /// The step loaded.
  int64_t step = 0;
  /// root/step-N.
  std::string directory;
  /// The metadata save() was given.
  nlohmann::json metadata = nlohmann::json::object();
  /// The world size of the save.
  int saved_world_size = 0;
  /// Names of this rank's pieces marked required = false that the
  /// checkpoint does not hold (left unchanged).
  std::vector<std::string> skipped;
};

/// Loads this rank's `pieces` (their tensors are written in place) from
/// step options.step() (default: the latest) under `root`. Collective over
/// `group` (empty: the world). Errors, on every rank, naming the file, the
/// tensor, the shapes and the rank that failed: `root` is not a checkpoint;
/// the step does not exist; a piece's tensor is missing from the checkpoint
/// or has another dtype or global shape; the saved pieces do not cover a
/// destination; a shard file is missing, truncated or fails its checksum;
/// with strict(), the checkpoint holds tensors nobody loads.
///
/// Example:
///   auto pieces = checkpoint::module_pieces(*model, "model/");  // at any TP size
///   auto result = checkpoint::load("ckpt", pieces);
///   int epoch = result.metadata.at("epoch");
// [load]
LoadResult load(const std::string& root, const std::vector<TensorPiece>& pieces, const LoadOptions& options = {},
                const Group& group = Group());
// [end load]

}  // namespace commgrad::checkpoint
