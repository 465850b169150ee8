#pragma once
// One safetensors file (huggingface/safetensors) in and out: the format
// commgrad's checkpoints are made of, for weights that come from or go to
// other programs (Python's safetensors.torch, Hugging Face models).

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <string>

namespace commgrad::checkpoint {

/// Every tensor of the safetensors file `path`, by key (in key order), on
/// the CPU. Errors name the file and what is wrong with it (truncated, a
/// bad header, an unsupported dtype).
///
/// Example:
///   auto weights = commgrad::checkpoint::read_safetensors("model.safetensors");
///   model->named_parameters()["fc.weight"].detach().copy_(weights["fc.weight"]);
torch::OrderedDict<std::string, at::Tensor> read_safetensors(const std::string& path);

/// Writes `tensors` (any strides, CPU) into a new safetensors file `path`.
///
/// Example:
///   commgrad::checkpoint::write_safetensors("out.safetensors", sharded.full_state_dict());
void write_safetensors(const std::string& path, const torch::OrderedDict<std::string, at::Tensor>& tensors);

}  // namespace commgrad::checkpoint
