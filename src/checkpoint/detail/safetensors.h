#pragma once
// Reading and writing safetensors files (huggingface/safetensors): an
// 8-byte little-endian header length N, N bytes of JSON
//   {"<key>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}, ...,
//    "__metadata__": {"<string>": "<string>"}}
// padded with spaces to a multiple of 8, then the data: each tensor's bytes,
// row-major, little-endian, at [b, e) counted from the end of the header,
// back to back without holes.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::checkpoint::detail {

/// "F32", "BF16", "BOOL", ... for the dtypes checkpoints support; throws for others.
const char* safetensors_dtype(at::ScalarType dtype);
/// The dtype of a safetensors code, or nullopt for an unknown/unsupported one.
std::optional<at::ScalarType> dtype_from_safetensors(const std::string& code);

/// zlib's crc32 of `size` bytes.
uint32_t crc32_of(const void* data, size_t size);

/// One tensor to write: `tensor` is contiguous and on the CPU.
struct SafetensorsEntry {
  std::string key;
  at::Tensor tensor;
};

/// What write_safetensors() put in the file, per entry in order.
struct WrittenEntry {
  std::string key;
  uint32_t crc32 = 0;  // of the tensor's bytes
};

/// Writes `entries` (in order) and `metadata` into a new file `path` and
/// fsyncs it; returns the file's size and each entry's checksum.
int64_t write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                          const std::map<std::string, std::string>& metadata, std::vector<WrittenEntry>& written);

/// One tensor described by a file's header.
struct SafetensorsInfo {
  std::string dtype;  // the safetensors code
  std::vector<int64_t> shape;
  int64_t begin = 0;  // data_offsets, relative to data_start
  int64_t end = 0;
};

/// A parsed, validated header.
struct SafetensorsHeader {
  std::string path;
  int64_t file_size = 0;
  int64_t data_start = 0;  // 8 + header length
  std::map<std::string, SafetensorsInfo> tensors;
  std::map<std::string, std::string> metadata;
};

/// Reads and checks the header of `path`: the length fits the file, the JSON
/// parses, every entry's offsets lie inside the file and match its dtype and
/// shape. Throws naming the file and what is wrong ("truncated", ...).
SafetensorsHeader read_safetensors_header(const std::string& path);

/// The raw bytes of `key` (header entry `info`) as a flat tensor of `dtype`.
at::Tensor read_safetensors_tensor(const SafetensorsHeader& header, const SafetensorsInfo& info, at::ScalarType dtype,
                                   uint32_t* crc32);

}  // namespace commgrad::checkpoint::detail
