// Box geometry for resharding.
//
// Every piece lives in the coordinates of its global tensor. Two boxes
// overlap where every dim's half-open interval does; the overlap is copied
// between the tensors shaped like each box through narrow() views, one per
// dim, so a copy is one strided at::copy_ of exactly the overlapping
// elements. Flat ranges are handled by the loader on top of this (a range of
// a box is placed into a buffer shaped like the box first).

#include "detail/boxes.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <sstream>

namespace commgrad::checkpoint::detail {

int64_t volume(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  return n;
}

std::string box_name(const Box& box) {
  std::ostringstream out;
  out << "[";
  for (size_t d = 0; d < box.shape.size(); ++d) {
    out << (d ? ", " : "") << box.offset[d] << ":" << box.offset[d] + box.shape[d];
  }
  out << "]";
  return out.str();
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  TORCH_INTERNAL_ASSERT(a.shape.size() == b.shape.size());
  Box out;
  for (size_t d = 0; d < a.shape.size(); ++d) {
    const int64_t lo = std::max(a.offset[d], b.offset[d]);
    const int64_t hi = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    if (hi <= lo) return std::nullopt;
    out.offset.push_back(lo);
    out.shape.push_back(hi - lo);
  }
  return out;
}

std::pair<int64_t, int64_t> flat_span(const Box& outer, const Box& inner) {
  // Row-major index of the first and of the last element of `inner`.
  int64_t first = 0;
  int64_t last = 0;
  for (size_t d = 0; d < outer.shape.size(); ++d) {
    first = first * outer.shape[d] + (inner.offset[d] - outer.offset[d]);
    last = last * outer.shape[d] + (inner.offset[d] + inner.shape[d] - 1 - outer.offset[d]);
  }
  return {first, last + 1};
}

at::Tensor box_view(const at::Tensor& box_tensor, const Box& outer, const Box& inner) {
  at::Tensor view = box_tensor;
  for (size_t d = 0; d < outer.shape.size(); ++d) {
    view = view.narrow(static_cast<int64_t>(d), inner.offset[d] - outer.offset[d], inner.shape[d]);
  }
  return view;
}

}  // namespace commgrad::checkpoint::detail
