// TensorPiece: checks and the descriptor ranks exchange.
//
// A piece is checked before anything reaches another rank or the disk: its
// box must lie inside the global shape, its range inside the box, and its
// tensor must hold exactly the range's element count in a dtype
// safetensors can name. The descriptor (PieceInfo) is the piece without its
// data, in JSON for the exchange and the index.

#include "commgrad/checkpoint/tensor_piece.h"

#include "detail/boxes.h"
#include "detail/safetensors.h"

#include "commgrad/util/names.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace commgrad::checkpoint {

TensorPiece TensorPiece::whole(std::string name, at::Tensor tensor) {
  TensorPiece piece;
  piece.name = std::move(name);
  if (tensor.defined()) piece.global_shape = tensor.sizes().vec();
  piece.tensor = std::move(tensor);
  return piece;
}

std::string describe(const TensorPiece& piece) {
  detail::Box box{piece.box_offset, piece.box_shape};
  if (box.shape.empty() && box.offset.empty()) {
    box.shape = piece.global_shape;
    box.offset.assign(piece.global_shape.size(), 0);
  }
  std::string out = c10::str("'", piece.name, "'");
  if (piece.tensor.defined()) out += c10::str(" ", dtype_name(piece.tensor.scalar_type()));
  if (box.offset.size() == box.shape.size()) {
    out += c10::str(" box ", detail::box_name(box), " of ", shape_name(piece.global_shape));
  } else {
    out += c10::str(" box offset ", shape_name(piece.box_offset), " shape ", shape_name(piece.box_shape), " of ",
                    shape_name(piece.global_shape));
  }
  const int64_t n = detail::volume(box.shape);
  const int64_t end = piece.flat_end < 0 ? n : piece.flat_end;
  if (piece.flat_begin != 0 || end != n) out += c10::str(" elements [", piece.flat_begin, ", ", end, ") of ", n);
  return out;
}

namespace detail {

PieceInfo check_piece(const TensorPiece& piece) {
  TORCH_CHECK(!piece.name.empty(), "a piece has an empty name (", describe(piece), ")");
  PieceInfo info;
  info.name = piece.name;
  info.global_shape = piece.global_shape;
  info.write = piece.write;
  info.required = piece.required;
  info.box = Box{piece.box_offset, piece.box_shape};
  const size_t nd = piece.global_shape.size();
  if (info.box.offset.empty() && info.box.shape.empty()) {
    info.box.offset.assign(nd, 0);
    info.box.shape = piece.global_shape;
  }
  TORCH_CHECK(info.box.offset.size() == nd && info.box.shape.size() == nd, "piece ", describe(piece),
              ": box_offset and box_shape need ", nd, " dims, like the global shape");
  for (size_t d = 0; d < nd; ++d) {
    TORCH_CHECK(piece.global_shape[d] >= 0 && info.box.offset[d] >= 0 && info.box.shape[d] >= 0 &&
                    info.box.offset[d] + info.box.shape[d] <= piece.global_shape[d],
                "piece ", describe(piece), ": the box does not lie inside the global shape (dim ", d, ")");
  }
  const int64_t n = volume(info.box.shape);
  info.flat_begin = piece.flat_begin;
  info.flat_end = piece.flat_end < 0 ? n : piece.flat_end;
  TORCH_CHECK(info.flat_begin >= 0 && info.flat_begin <= info.flat_end && info.flat_end <= n, "piece ", describe(piece),
              ": the element range is not inside the box of ", n, " elements");
  TORCH_CHECK(piece.tensor.defined(), "piece ", describe(piece), " has no tensor");
  TORCH_CHECK(!piece.source.defined() || piece.tensor.is_alias_of(piece.source), "piece ", describe(piece),
              " no longer views the parameter it was taken from: the parameter was re-pointed after the pieces were "
              "taken (ZeroOptimizer's constructor and Module::to() do that), so its values would be ",
              "saved or loaded stale; take module_pieces() after building the optimizer, or use "
              "checkpoint::save_training_state() / load_training_state(), which take the pieces when called");
  TORCH_CHECK(piece.tensor.numel() == info.count(), "piece ", describe(piece), ": its tensor ",
              tensor_name(piece.tensor), " has ", piece.tensor.numel(), " elements, the piece holds ", info.count());
  info.dtype = safetensors_dtype(piece.tensor.scalar_type());
  return info;
}

nlohmann::json to_json(const PieceInfo& info) {
  return {{"name", info.name},
          {"dtype", info.dtype},
          {"global_shape", info.global_shape},
          {"box_offset", info.box.offset},
          {"box_shape", info.box.shape},
          {"flat_range", {info.flat_begin, info.flat_end}},
          {"write", info.write},
          {"required", info.required}};
}

PieceInfo piece_from_json(const nlohmann::json& j) {
  PieceInfo info;
  info.name = j.at("name").get<std::string>();
  info.dtype = j.at("dtype").get<std::string>();
  info.global_shape = j.at("global_shape").get<std::vector<int64_t>>();
  info.box.offset = j.at("box_offset").get<std::vector<int64_t>>();
  info.box.shape = j.at("box_shape").get<std::vector<int64_t>>();
  const auto range = j.at("flat_range").get<std::vector<int64_t>>();
  TORCH_CHECK(range.size() == 2, "flat_range of '", info.name, "' needs 2 numbers");
  info.flat_begin = range[0];
  info.flat_end = range[1];
  info.write = j.value("write", true);
  info.required = j.value("required", true);
  return info;
}

}  // namespace detail
}  // namespace commgrad::checkpoint
