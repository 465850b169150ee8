// The safetensors container, written and read without a third-party
// library: the format is one JSON header (nlohmann-json) and raw bytes.
//
// Writing streams the tensors one after the other through one file
// descriptor (no copy of the whole file in memory) and computes each
// tensor's crc32 on the way; the checksums go into the checkpoint's index,
// not into the file, so that Python's safetensors reads the file unchanged.
// Reading parses the header, checks every offset against the file's size
// (a truncated file fails here, naming the file, before any data is read),
// then reads each tensor's byte range on demand.
//
// Byte order: safetensors is little-endian, as every platform LibTorch
// supports for training is; tensors are written as they lie in memory.

#include "detail/safetensors.h"

#include "detail/files.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include <cerrno>
#include <fstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace commgrad::checkpoint::detail {

namespace {

struct DtypeCode {
  at::ScalarType dtype;
  const char* code;
};

constexpr DtypeCode kDtypes[] = {
    {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"}, {at::kLong, "I64"},
    {at::kInt, "I32"},   {at::kShort, "I16"},  {at::kChar, "I8"},       {at::kByte, "U8"},  {at::kBool, "BOOL"},
};

// Largest header accepted (the reference implementation's limit).
constexpr int64_t kMaxHeader = 100 << 20;

}  // namespace

const char* safetensors_dtype(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.code;
  }
  TORCH_CHECK(false,
              "checkpoints hold float32, float64, bfloat16, float16, int64, int32, int16, int8, uint8 and bool "
              "tensors, not ",
              c10::toString(dtype));
}

std::optional<at::ScalarType> dtype_from_safetensors(const std::string& code) {
  for (const auto& d : kDtypes) {
    if (code == d.code) return d.dtype;
  }
  return std::nullopt;
}

uint32_t crc32_of(const void* data, size_t size) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  // zlib takes uInt lengths: feed large buffers in 1 GiB pieces.
  constexpr size_t kChunk = size_t(1) << 30;
  while (size > 0) {
    const size_t n = std::min(size, kChunk);
    crc = ::crc32(crc, p, static_cast<uInt>(n));
    p += n;
    size -= n;
  }
  return static_cast<uint32_t>(crc);
}

int64_t write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                          const std::map<std::string, std::string>& metadata, std::vector<WrittenEntry>& written) {
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  for (const auto& e : entries) {
    TORCH_INTERNAL_ASSERT(e.tensor.is_contiguous() && e.tensor.device().is_cpu());
    const int64_t bytes = static_cast<int64_t>(e.tensor.nbytes());
    header[e.key] = {{"dtype", safetensors_dtype(e.tensor.scalar_type())},
                     {"shape", e.tensor.sizes().vec()},
                     {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t length = text.size();
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(length >> (8 * i));

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create ", path, ": ", errno_message());
  write_all(fd, prefix, sizeof(prefix), path);
  write_all(fd, text.data(), text.size(), path);
  written.clear();
  for (const auto& e : entries) {
    const size_t bytes = e.tensor.nbytes();
    const void* data = bytes > 0 ? e.tensor.data_ptr() : nullptr;
    if (bytes > 0) write_all(fd, data, bytes, path);
    written.push_back({e.key, crc32_of(data, bytes)});
  }
  if (::fsync(fd) != 0) {
    const std::string why = errno_message();
    ::close(fd);
    TORCH_CHECK(false, "cannot fsync ", path, ": ", why);
  }
  TORCH_CHECK(::close(fd) == 0, "cannot close ", path, ": ", errno_message());
  return 8 + static_cast<int64_t>(length) + offset;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  SafetensorsHeader h;
  h.path = path;
  struct stat st {};
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "shard file ", path, " is missing: ", errno_message());
  h.file_size = static_cast<int64_t>(st.st_size);
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open shard file ", path, ": ", errno_message());
  unsigned char prefix[8] = {};
  in.read(reinterpret_cast<char*>(prefix), 8);
  TORCH_CHECK(in.gcount() == 8, "shard file ", path, " is truncated: ", h.file_size,
              " bytes, shorter than a safetensors header");
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= uint64_t(prefix[i]) << (8 * i);
  TORCH_CHECK(length <= uint64_t(kMaxHeader) && int64_t(8 + length) <= h.file_size, "shard file ", path,
              " is truncated or not a safetensors file: its header claims ", length, " bytes, the file has ",
              h.file_size);
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  TORCH_CHECK(in.gcount() == static_cast<std::streamsize>(length), "cannot read the header of ", path);
  h.data_start = 8 + static_cast<int64_t>(length);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "shard file ", path, " has a corrupt safetensors header: ", e.what());
  }
  TORCH_CHECK(header.is_object(), "shard file ", path, " has a corrupt safetensors header (not a JSON object)");
  const int64_t data_size = h.file_size - h.data_start;
  try {
    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        for (const auto& [k, v] : value.items()) h.metadata[k] = v.get<std::string>();
        continue;
      }
      SafetensorsInfo info;
      info.dtype = value.at("dtype").get<std::string>();
      info.shape = value.at("shape").get<std::vector<int64_t>>();
      const auto offsets = value.at("data_offsets").get<std::vector<int64_t>>();
      TORCH_CHECK(offsets.size() == 2, "shard file ", path, ": '", key, "' has ", offsets.size(),
                  " data_offsets, expected 2");
      info.begin = offsets[0];
      info.end = offsets[1];
      TORCH_CHECK(info.begin >= 0 && info.begin <= info.end, "shard file ", path, ": '", key,
                  "' has invalid data_offsets [", info.begin, ", ", info.end, "]");
      TORCH_CHECK(info.end <= data_size, "shard file ", path, " is truncated: '", key, "' ends at byte ",
                  h.data_start + info.end, " of a file of ", h.file_size, " bytes");
      h.tensors.emplace(key, std::move(info));
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "shard file ", path, " has a corrupt safetensors header: ", e.what());
  }
  return h;
}

at::Tensor read_safetensors_tensor(const SafetensorsHeader& header, const SafetensorsInfo& info, at::ScalarType dtype,
                                   uint32_t* crc32) {
  const int64_t bytes = info.end - info.begin;
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(bytes % item == 0, "shard file ", header.path, ": an entry of ", bytes,
              " bytes is not a whole number of ", c10::toString(dtype), " elements");
  at::Tensor out = at::empty({bytes / item}, at::TensorOptions().dtype(dtype));
  if (bytes > 0) {
    std::ifstream in(header.path, std::ios::binary);
    TORCH_CHECK(in.good(), "cannot open shard file ", header.path, ": ", errno_message());
    in.seekg(header.data_start + info.begin);
    in.read(static_cast<char*>(out.data_ptr()), bytes);
    TORCH_CHECK(in.gcount() == bytes, "shard file ", header.path, " is truncated: expected ", bytes,
                " bytes at offset ", header.data_start + info.begin);
  }
  if (crc32 != nullptr) *crc32 = crc32_of(bytes > 0 ? out.data_ptr() : nullptr, static_cast<size_t>(bytes));
  return out;
}

}  // namespace commgrad::checkpoint::detail
