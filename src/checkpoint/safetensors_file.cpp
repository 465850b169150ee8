// One safetensors file in and out, on the reader and writer the checkpoints use.

#include "commgrad/checkpoint/safetensors_file.h"

#include "detail/safetensors.h"

#include <c10/util/Exception.h>

#include <vector>

namespace commgrad::checkpoint {

torch::OrderedDict<std::string, at::Tensor> read_safetensors(const std::string& path) {
  const auto header = detail::read_safetensors_header(path);
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& [key, info] : header.tensors) {
    const auto dtype = detail::dtype_from_safetensors(info.dtype);
    TORCH_CHECK_VALUE(dtype.has_value(), "[commgrad] read_safetensors: ", path, ": '", key, "' has dtype ", info.dtype,
                      ", which commgrad does not read");
    out.insert(key, detail::read_safetensors_tensor(header, info, *dtype, nullptr).reshape(info.shape));
  }
  return out;
}

void write_safetensors(const std::string& path, const torch::OrderedDict<std::string, at::Tensor>& tensors) {
  std::vector<detail::SafetensorsEntry> entries;
  for (const auto& item : tensors) entries.push_back({item.key(), item.value().detach().cpu().contiguous()});
  std::vector<detail::WrittenEntry> written;
  detail::write_safetensors(path, entries, {}, written);
}

}  // namespace commgrad::checkpoint
