#pragma once
// The names errors and tables give dtypes, shapes and tensors: PyTorch's
// dtype names without the "torch." ("float32", "bfloat16"), shapes as lists.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <string>

namespace commgrad {

/// "float32", "bfloat16", "int64", ... (torch.<name> in Python).
const char* dtype_name(at::ScalarType dtype);

/// "[4, 3]"; with `wild_dim` >= 0 that size prints as '*' ("[*, 3]").
std::string shape_name(at::IntArrayRef sizes, int64_t wild_dim = -1);

/// "float32[4, 3]": dtype and shape (see shape_name for `wild_dim`).
std::string tensor_name(const at::Tensor& x, int64_t wild_dim = -1);

}  // namespace commgrad
