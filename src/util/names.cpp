// Names of dtypes, shapes and tensors in messages.

#include "commgrad/util/names.h"

namespace commgrad {

const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kByte:
      return "uint8";
    case at::kChar:
      return "int8";
    case at::kShort:
      return "int16";
    case at::kInt:
      return "int32";
    case at::kLong:
      return "int64";
    case at::kBool:
      return "bool";
    case at::kComplexFloat:
      return "complex64";
    case at::kComplexDouble:
      return "complex128";
    default:
      return c10::toString(dtype);
  }
}

std::string shape_name(at::IntArrayRef sizes, int64_t wild_dim) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) s += ", ";
    s += static_cast<int64_t>(i) == wild_dim ? std::string("*") : std::to_string(sizes[i]);
  }
  return s + "]";
}

std::string tensor_name(const at::Tensor& x, int64_t wild_dim) {
  return std::string(dtype_name(x.scalar_type())) + shape_name(x.sizes(), wild_dim);
}

}  // namespace commgrad
