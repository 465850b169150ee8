#pragma once
// Geometry of pieces: validated piece descriptors, N-d box intersection, and
// the copy of an overlap between two boxes.

#include "commgrad/checkpoint/tensor_piece.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::checkpoint::detail {

/// An N-d box: offset and shape in a global tensor.
struct Box {
  std::vector<int64_t> offset;
  std::vector<int64_t> shape;
  bool operator==(const Box& other) const { return offset == other.offset && shape == other.shape; }
};

int64_t volume(const std::vector<int64_t>& shape);
/// "[4:8, 0:4]"
std::string box_name(const Box& box);
/// The intersection of two boxes of the same rank; nullopt when empty.
std::optional<Box> intersect(const Box& a, const Box& b);
/// [first, last + 1): the flat indices (row-major in `outer`) that `inner`
/// (a box inside `outer`) spans.
std::pair<int64_t, int64_t> flat_span(const Box& outer, const Box& inner);
/// The view of `box_tensor` (shaped like `outer`) that covers `inner`.
at::Tensor box_view(const at::Tensor& box_tensor, const Box& outer, const Box& inner);

/// A checked, normalised TensorPiece without its data: what ranks exchange
/// and what the index records.
struct PieceInfo {
  std::string name;
  std::string dtype;  // safetensors code ("F32")
  std::vector<int64_t> global_shape;
  Box box;
  int64_t flat_begin = 0;
  int64_t flat_end = 0;
  bool write = true;
  bool required = true;

  int64_t count() const { return flat_end - flat_begin; }
  bool whole_box() const { return flat_begin == 0 && flat_end == volume(box.shape); }
  /// Same tensor region (name, box, range): replicas of one another.
  bool same_region(const PieceInfo& other) const {
    return name == other.name && box == other.box && flat_begin == other.flat_begin && flat_end == other.flat_end;
  }
};

/// Checks `piece` (box inside the global shape, range inside the box, tensor
/// of the right numel and a supported dtype) and normalises it (empty box:
/// the whole tensor; flat_end -1: the box's end). Throws naming the piece.
PieceInfo check_piece(const TensorPiece& piece);

nlohmann::json to_json(const PieceInfo& info);
PieceInfo piece_from_json(const nlohmann::json& j);

}  // namespace commgrad::checkpoint::detail
