#pragma once
// index.json: what a step directory holds.
//
//   {"format": "commgrad-checkpoint", "version": 1, "step": 10, "world_size": 4,
//    "metadata": {...user json...},
//    "files": {"rank-00000.safetensors": {"rank": 0, "bytes": 4242}, ...},
//    "tensors": {"model/fc1.weight": {"dtype": "F32", "global_shape": [8, 4], "required": true,
//        "pieces": [{"file": "rank-00000.safetensors", "key": "model/fc1.weight",
//                    "box_offset": [0, 0], "box_shape": [4, 4], "flat_range": [0, 16],
//                    "crc32": 1234567}, ...]}, ...}}

#include "detail/boxes.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace commgrad::checkpoint::detail {

inline constexpr const char* kIndexFormat = "commgrad-checkpoint";
inline constexpr int kIndexVersion = 1;

struct SavedPiece {
  Box box;
  int64_t flat_begin = 0;
  int64_t flat_end = 0;
  std::string file;  // inside the step directory
  std::string key;   // in that file's safetensors header
  uint32_t crc32 = 0;
  bool whole_box() const { return flat_begin == 0 && flat_end == volume(box.shape); }
};

struct SavedTensor {
  std::string dtype;  // safetensors code
  std::vector<int64_t> global_shape;
  bool required = true;
  std::vector<SavedPiece> pieces;
};

struct SavedFile {
  int rank = 0;
  int64_t bytes = 0;
};

struct Index {
  int64_t step = 0;
  int world_size = 0;
  nlohmann::json metadata = nlohmann::json::object();
  std::map<std::string, SavedFile> files;
  std::map<std::string, SavedTensor> tensors;
};

std::string serialize_index(const Index& index);
/// Parses and checks an index read from `path` (named in errors).
Index parse_index(const std::string& text, const std::string& path);

}  // namespace commgrad::checkpoint::detail
