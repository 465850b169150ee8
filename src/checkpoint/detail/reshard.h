#pragma once
// Filling one destination piece from the saved pieces of its tensor.

#include "detail/boxes.h"
#include "detail/index.h"
#include "detail/safetensors.h"

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace commgrad::checkpoint::detail {

/// Reads saved pieces from the shard files of one step directory, checking
/// each file's size against the index and each entry against its crc32.
/// Keeps what it read until clear(), so a saved piece that overlaps several
/// destination pieces is read once.
class ShardReader {
 public:
  ShardReader(std::string directory, const Index& index) : directory_(std::move(directory)), index_(index) {}

  /// The data of `piece` (of tensor `name`, dtype `dtype`) as a flat tensor.
  at::Tensor read(const std::string& name, const SavedTensor& tensor, const SavedPiece& piece);
  void clear() { cache_.clear(); }

 private:
  const SafetensorsHeader& header(const std::string& file);

  std::string directory_;
  const Index& index_;
  std::map<std::string, SafetensorsHeader> headers_;
  std::map<std::string, at::Tensor> cache_;  // by file + '\n' + key
};

/// The elements of destination `dest` (a flat tensor of dest.count()
/// elements, in its box's row-major order) assembled from `tensor`'s saved
/// pieces. Throws, naming the piece and what is missing, when they do not
/// cover it.
at::Tensor assemble(const PieceInfo& dest, const SavedTensor& tensor, ShardReader& reader);

}  // namespace commgrad::checkpoint::detail
