// The checkpoint index (index.json), written by rank 0 once every rank's
// shard file is on disk, read by every rank at load.
//
// Parsing checks the structure fully (every piece names a listed file and a
// box inside its tensor's global shape) so that load never indexes out of
// bounds on a hand-edited or foreign file: an index that fails is reported
// as "not a commgrad checkpoint index" or by the field that is wrong.

#include "detail/index.h"

#include "detail/safetensors.h"

#include <c10/util/Exception.h>

namespace commgrad::checkpoint::detail {

std::string serialize_index(const Index& index) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& [name, f] : index.files) files[name] = {{"rank", f.rank}, {"bytes", f.bytes}};
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& [name, t] : index.tensors) {
    nlohmann::json pieces = nlohmann::json::array();
    for (const auto& p : t.pieces) {
      pieces.push_back({{"file", p.file},
                        {"key", p.key},
                        {"box_offset", p.box.offset},
                        {"box_shape", p.box.shape},
                        {"flat_range", {p.flat_begin, p.flat_end}},
                        {"crc32", p.crc32}});
    }
    tensors[name] = {
        {"dtype", t.dtype}, {"global_shape", t.global_shape}, {"required", t.required}, {"pieces", pieces}};
  }
  const nlohmann::json j = {
      {"format", kIndexFormat},     {"version", kIndexVersion}, {"step", index.step}, {"world_size", index.world_size},
      {"metadata", index.metadata}, {"files", files},           {"tensors", tensors}};
  return j.dump(1) + "\n";
}

Index parse_index(const std::string& text, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path, " is not a commgrad checkpoint index (", e.what(), ")");
  }
  TORCH_CHECK(j.is_object() && j.value("format", std::string()) == kIndexFormat, path,
              " is not a commgrad checkpoint index (no \"format\": \"", kIndexFormat, "\")");
  TORCH_CHECK(j.value("version", 0) == kIndexVersion, path, " has index version ", j.value("version", 0),
              "; this commgrad reads version ", kIndexVersion);
  Index index;
  try {
    index.step = j.at("step").get<int64_t>();
    index.world_size = j.at("world_size").get<int>();
    index.metadata = j.value("metadata", nlohmann::json::object());
    for (const auto& [name, f] : j.at("files").items()) {
      index.files[name] = SavedFile{f.at("rank").get<int>(), f.at("bytes").get<int64_t>()};
    }
    for (const auto& [name, t] : j.at("tensors").items()) {
      SavedTensor saved;
      saved.dtype = t.at("dtype").get<std::string>();
      saved.global_shape = t.at("global_shape").get<std::vector<int64_t>>();
      saved.required = t.value("required", true);
      TORCH_CHECK(dtype_from_safetensors(saved.dtype).has_value(), path, ": tensor '", name, "' has dtype '",
                  saved.dtype, "', which commgrad does not read");
      for (const auto& p : t.at("pieces")) {
        SavedPiece piece;
        piece.file = p.at("file").get<std::string>();
        piece.key = p.at("key").get<std::string>();
        piece.box.offset = p.at("box_offset").get<std::vector<int64_t>>();
        piece.box.shape = p.at("box_shape").get<std::vector<int64_t>>();
        const auto range = p.at("flat_range").get<std::vector<int64_t>>();
        piece.crc32 = p.at("crc32").get<uint32_t>();
        TORCH_CHECK(range.size() == 2, path, ": a piece of '", name, "' has a flat_range of ", range.size(),
                    " numbers");
        piece.flat_begin = range[0];
        piece.flat_end = range[1];
        TORCH_CHECK(index.files.count(piece.file), path, ": a piece of '", name, "' names file '", piece.file,
                    "', which the index does not list");
        const size_t nd = saved.global_shape.size();
        bool inside = piece.box.offset.size() == nd && piece.box.shape.size() == nd;
        for (size_t d = 0; inside && d < nd; ++d) {
          inside = piece.box.offset[d] >= 0 && piece.box.shape[d] >= 0 &&
                   piece.box.offset[d] + piece.box.shape[d] <= saved.global_shape[d];
        }
        inside = inside && piece.flat_begin >= 0 && piece.flat_begin <= piece.flat_end &&
                 piece.flat_end <= volume(piece.box.shape);
        TORCH_CHECK(inside, path, ": a piece of '", name, "' lies outside the tensor's global shape");
        saved.pieces.push_back(std::move(piece));
      }
      index.tensors.emplace(name, std::move(saved));
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path, " is a corrupt commgrad checkpoint index: ", e.what());
  }
  return index;
}

}  // namespace commgrad::checkpoint::detail
