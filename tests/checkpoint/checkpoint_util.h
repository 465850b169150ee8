#pragma once
// Helpers of the checkpoint tests: a temporary root, test tensors of every
// dtype, splits, and the error check.

#include "harness/expect_error.h"
#include "harness/temp_dir.h"

#include <commgrad/checkpoint.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace commgrad::testing {

/// The global test tensor: element i is i (mod something the dtype holds), of `dtype`.
inline at::Tensor global_tensor(at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  at::Tensor t = at::arange(n, at::kLong);
  if (dtype == at::kBool)
    t = t.remainder(3) == 1;
  else if (dtype == at::kByte || dtype == at::kChar)
    t = t.remainder(100);
  return t.to(dtype).reshape(shape);
}

/// [begin, end) of part `i` of `n` of a length (the first parts one longer when uneven).
inline std::pair<int64_t, int64_t> split(int64_t length, int n, int i) {
  const int64_t base = length / n;
  const int64_t extra = length % n;
  const int64_t begin = i * base + std::min<int64_t>(i, extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

/// The piece of `full` that is rank i of n's part along `dim` (a copy, or a view with `view`).
inline checkpoint::TensorPiece row_piece(const std::string& name, const at::Tensor& full, int64_t dim, int n, int i) {
  const auto [b, e] = split(full.size(dim), n, i);
  checkpoint::TensorPiece p;
  p.name = name;
  p.global_shape = full.sizes().vec();
  p.box_offset.assign(full.dim(), 0);
  p.box_offset[dim] = b;
  p.box_shape = full.sizes().vec();
  p.box_shape[dim] = e - b;
  p.tensor = full.narrow(dim, b, e - b).clone();
  return p;
}

}  // namespace commgrad::testing
