#pragma once
// checkpoint::save: every rank writes its own pieces of a step, crash-safe.
//
// Collective over `group` (the world normally): every rank calls save() with
// the same root and step and its own pieces. What happens:
//   1. every rank checks its pieces, and the ranks exchange their
//      descriptors (names, dtypes, shapes, boxes; no data). Pieces that
//      describe the same region of the same tensor on several ranks
//      (replicas on data-parallel ranks, TP-replicated biases) are written
//      once, by the lowest of those ranks; the pieces written must cover
//      every tensor exactly once (else an error names the tensor).
//   2. rank 0 removes what interrupted saves left, prunes old steps so that
//      keep(k) needs room for k steps (see SaveOptions::keep), and creates
//      the hidden directory root/.step-N.partial.
//   3. every rank with pieces to write writes rank-<r>.safetensors there and
//      fsyncs it.
//   4. rank 0 writes index.json, renames the directory to root/step-N and
//      replaces root/latest atomically (write, fsync, rename).
// Each phase ends in an exchange of every rank's status: when any rank
// fails, every rank throws (none waits for the failed one), and the previous
// checkpoint stays the one `latest` names, and rank 0 removes the partial
// directory (a full disk stays full no longer than the failed save). A rank
// killed mid-save leaves the partial directory, which the next save removes.

#include "commgrad/checkpoint/tensor_piece.h"
#include "commgrad/dist/group.h"

#include <nlohmann/json.hpp>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace commgrad::checkpoint {

/// Options of save().
///
/// Example:
///   checkpoint::save("ckpt", step, pieces, {{"epoch", 3}}, checkpoint::SaveOptions().keep(2));
struct SaveOptions {
  /// Called after each file this rank wrote is on disk (its shard file; on
  /// rank 0 also index.json and latest), with the path and its size.
  using FileWritten = std::function<void(const std::string& path, int64_t bytes)>;
  using PublishStep = std::function<void(const std::string& step)>;

  /// Keep only the newest `keep` complete steps (0: keep every step). The
  /// oldest are removed before the save writes, down to keep - 1 but never
  /// the newest, so the root needs room for `keep` steps (2 when keep is 1).
  TORCH_ARG(int64_t, keep) = 0;
  /// Progress callback (tests use it to kill a rank at a chosen point). An
  /// exception it throws fails the save on every rank.
  TORCH_ARG(FileWritten, on_file_written);
  /// Called on rank 0 after each step of the publish sequence: "index"
  /// (index.json durable in the partial directory), "renamed" (step-N in
  /// place), "latest.tmp" (the new pointer durable beside `latest`),
  /// "latest" (replaced) and "pruned". Tests kill the process there.
  TORCH_ARG(PublishStep, on_publish);
};

/// What save() did.
struct SaveResult {
  int64_t step = 0;
  /// root/step-N.
  std::string directory;
  /// Bytes this rank wrote (0 for a rank whose pieces others write).
  int64_t bytes_written = 0;
};

/// Saves `pieces` as step `step` under `root` (created when missing), with
/// `metadata` (any JSON, e.g. the epoch, the data loader's position) in the
/// index. Collective over `group` (empty: the world). Errors, on every rank,
/// when a piece is malformed, when ranks disagree on a tensor's dtype or
/// global shape, when the pieces written overlap or leave part of a tensor
/// uncovered, or when a file cannot be written.
///
/// Example:
///   auto pieces = checkpoint::module_pieces(*model, "model/");
///   auto rng = checkpoint::rng_pieces(tp::rng_tracker(), tp_group);
///   pieces.insert(pieces.end(), rng.begin(), rng.end());
///   checkpoint::save("ckpt", step, pieces, {{"epoch", epoch}});
// [save]
SaveResult save(const std::string& root, int64_t step, const std::vector<TensorPiece>& pieces,
                const nlohmann::json& metadata = nlohmann::json::object(), const SaveOptions& options = {},
                const Group& group = Group());
// [end save]

}  // namespace commgrad::checkpoint
