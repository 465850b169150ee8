// Argument checks shared by the raw ops.

#include "detail/checks.h"

#include "commgrad/dist/check.h"
#include "commgrad/util/names.h"

namespace commgrad::ops::detail {

void check_tensor(const Call& call, const at::Tensor& x) {
  COMMGRAD_CHECK(x.defined(), call.op, call.group, "got an undefined tensor");
  COMMGRAD_CHECK(x.layout() == at::kStrided, call.op, call.group, "needs a dense (strided) tensor, got layout ",
                 x.layout());
}

int64_t check_dim(const Call& call, const at::Tensor& x, int64_t dim) {
  const int64_t nd = x.dim();
  COMMGRAD_CHECK(nd > 0, call.op, call.group, "dim ", dim, " is out of range: the tensor is a scalar (", tensor_name(x),
                 "); this op needs at least one dimension");
  COMMGRAD_CHECK(dim >= -nd && dim < nd, call.op, call.group, "dim ", dim, " is out of range for ", tensor_name(x),
                 " (expected ", -nd, "..", nd - 1, ")");
  return dim < 0 ? dim + nd : dim;
}

void check_divisible(const Call& call, const at::Tensor& x, int64_t dim) {
  COMMGRAD_CHECK(x.size(dim) % call.size == 0, call.op, call.group, "dim ", dim, " of ", tensor_name(x), " has size ",
                 x.size(dim), ", which is not divisible by the group size ", call.size);
}

void check_peer(const Call& call, const char* what, int peer) {
  COMMGRAD_CHECK(peer >= 0 && peer < call.size, call.op, call.group, what, " ", peer,
                 " is outside the group (group ranks 0..", call.size - 1, "; ", what,
                 " is a rank within the group, not a global rank)");
}

void check_sizes(const Call& call, const char* what, const std::vector<int64_t>& sizes, int64_t total,
                 const at::Tensor& x, int64_t dim) {
  const at::IntArrayRef shown(sizes);
  COMMGRAD_CHECK(static_cast<int>(sizes.size()) == call.size, call.op, call.group, what, " ", shown, " has ",
                 sizes.size(), " entries; expected one per rank (", call.size, ")");
  int64_t sum = 0;
  for (int64_t s : sizes) {
    COMMGRAD_CHECK(s >= 0, call.op, call.group, what, " ", shown, " has a negative entry");
    sum += s;
  }
  COMMGRAD_CHECK(total < 0 || sum == total, call.op, call.group, what, " ", shown, " add up to ", sum, ", but dim ",
                 dim, " of ", tensor_name(x), " has size ", total);
}

}  // namespace commgrad::ops::detail
