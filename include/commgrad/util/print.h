#pragma once
// Printing tensors the way PyTorch's Python prints them.

#include "commgrad/util/blas.h"  // active_blas(), formerly declared here

#include <ATen/core/Tensor.h>

#include <ostream>
#include <string>
#include <vector>

namespace commgrad {

/// Formats `t` as Python's `repr(tensor)` does: `tensor([4., 4., 4., 4.])`,
/// `tensor([[1, 2],\n        [3, 4]])`, `tensor(0.5000, dtype=torch.float64)`,
/// with `requires_grad=True` / `grad_fn=<...>` suffixes and `...` summaries
/// above 1000 elements, like torch's default print options.
///
/// Example:
///   std::cout << "x.grad = " << commgrad::format_tensor(x.grad()) << "\n";
std::string format_tensor(const at::Tensor& t);

/// Streams `format_tensor(t)`.
struct PythonRepr {
  const at::Tensor& tensor;
};
std::ostream& operator<<(std::ostream& os, const PythonRepr& repr);

/// Formats a rank list as Python prints a list: "[0, 2, 3]".
std::string format_ranks(const std::vector<int>& ranks);

}  // namespace commgrad
