// Ulysses' all-to-alls (ulysses.h) as one ops::all_to_all each.
//
// sequence_to_heads: [b, H, s_l, d] is viewed as [b, W, H/W, s_l, d] and
// the head-group dim moved to the front, [W, b, H/W, s_l, d]; an all-to-all
// along dim 0 sends group j to rank j and returns [W (source rank), b, H/W,
// s_l, d], which is moved to [b, H/W, W s_l, d]. heads_to_sequence runs the
// same steps backwards. Each rank sends and receives (W-1)/W of its x.

#include "commgrad/cp/ulysses.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/collectives.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>

namespace commgrad::cp {

namespace {

void check_heads_input(const char* op, const Group& group, const at::Tensor& x, int64_t split_dim) {
  check_member(op, group);
  COMMGRAD_CHECK(x.defined() && x.dim() == 4, op, group, "expected [batch, heads, tokens, head_dim], got ",
                 x.defined() ? tensor_name(x) : std::string("an undefined tensor"));
  COMMGRAD_CHECK(x.size(split_dim) % group.size() == 0, op, group, "dim ", split_dim, " of ", tensor_name(x),
                 split_dim == 1 ? " (heads)" : " (tokens)", " is not divisible by the context-parallel size ",
                 group.size(), split_dim == 1 ? ": Ulysses gives each rank heads / W whole heads" : "");
}

}  // namespace

at::Tensor sequence_to_heads(const at::Tensor& x, const Group& group) {
  check_heads_input("cp::sequence_to_heads", group, x, 1);
  const int64_t w = group.size(), b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  if (w == 1) return x;
  const at::Tensor front = x.reshape({b, w, h / w, s, d}).permute({1, 0, 2, 3, 4});
  const at::Tensor got = ops::all_to_all(front, ops::AllToAllOptions().dim(0), group);  // [W, b, H/W, s, d]
  return got.permute({1, 2, 0, 3, 4}).reshape({b, h / w, w * s, d});
}

at::Tensor heads_to_sequence(const at::Tensor& x, const Group& group) {
  check_heads_input("cp::heads_to_sequence", group, x, 2);
  const int64_t w = group.size(), b = x.size(0), hl = x.size(1), s = x.size(2), d = x.size(3);
  if (w == 1) return x;
  const at::Tensor front = x.reshape({b, hl, w, s / w, d}).permute({2, 0, 1, 3, 4});
  const at::Tensor got =
      ops::all_to_all(front, ops::AllToAllOptions().dim(0), group);  // [W (head group), b, H/W, s/W, d]
  return got.permute({1, 0, 2, 3, 4}).reshape({b, w * hl, s / w, d});
}

}  // namespace commgrad::cp
