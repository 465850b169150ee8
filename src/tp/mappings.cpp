// The Family 2 region mappings (Megatron's mappings.py).
//
// Naming follows Megatron: a "region" is the part of the model between two
// mappings in which activations are split across the tensor-parallel group
// (TP region: split along the hidden/last dim; sequence-parallel region:
// split along the sequence, dim 0). "copy_to" / "scatter_to" enter a region,
// "reduce_from" / "gather_from" leave it. The objective is one replicated
// loss (Family 2), so each mapping's backward is the adjoint of its forward
// as a linear map between the replicated and the split representation:
//   identity      <-> all_reduce       (copy_to / reduce_from)
//   keep my chunk <-> all_gather       (scatter_to / gather_from, TP region)
//   all_gather    <-> reduce_scatter   (sequence-parallel gather / reduce_scatter)
//
// Each mapping is a small autograd Function over ops::raw (the raw layer
// carries the Gloo workarounds: reduce_scatter from alltoall, etc.). Shapes
// and divisibility are checked before any communication and before the
// single-rank short cut, so misuse shows at TP = 1 too.

#include "commgrad/tp/mappings.h"

#include "detail/common.h"

#include "commgrad/ops/raw.h"
#include "commgrad/tp/parallel_state.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

namespace commgrad::tp {

namespace detail {

std::string describe(const at::Tensor& x) {
  if (!x.defined()) return "undefined";
  const at::ScalarType t = x.scalar_type();
  const char* name = t == at::kFloat      ? "float32"
                     : t == at::kDouble   ? "float64"
                     : t == at::kHalf     ? "float16"
                     : t == at::kBFloat16 ? "bfloat16"
                     : t == at::kLong     ? "int64"
                     : t == at::kInt      ? "int32"
                                          : c10::toString(t);
  std::string s = c10::str(name, "[");
  for (int64_t i = 0; i < x.dim(); ++i) s += (i > 0 ? ", " : "") + std::to_string(x.size(i));
  return s + "]";
}

int64_t check_dim(const char* op, const Group& group, const at::Tensor& x, int64_t dim) {
  COMMGRAD_CHECK(x.defined(), op, group, "got an undefined tensor");
  COMMGRAD_CHECK(x.layout() == at::kStrided, op, group, "needs a dense (strided) tensor, got layout ", x.layout());
  const int64_t nd = x.dim();
  COMMGRAD_CHECK(nd > 0, op, group, "needs a tensor with at least one dimension, got ", describe(x));
  COMMGRAD_CHECK(dim >= -nd && dim < nd, op, group, "dim ", dim, " is out of range for ", describe(x));
  return dim < 0 ? dim + nd : dim;
}

void check_divisible(const char* op, const Group& group, const at::Tensor& x, int64_t dim, int64_t parts) {
  COMMGRAD_CHECK(x.size(dim) % parts == 0, op, group, "dim ", dim, " of ", describe(x), " has size ", x.size(dim),
                 ", which is not divisible by the tensor-parallel size ", parts);
}

}  // namespace detail

namespace {

using detail::save_group;
using detail::saved_group;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor own_chunk(const at::Tensor& x, int64_t dim, const Group& group) {
  return x.chunk(group.size(), dim)[group.rank()].contiguous();
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, const Group& group) {
  return ops::raw::all_gather(x, ops::AllGatherOptions().dim(dim), group).wait();
}

// ~~~ copy_to / reduce_from ~~~

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& group) {
    save_group(ctx, group);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ops::raw::all_reduce(grads[0], {}, saved_group(ctx)).wait(), {}};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, const Group& group) {
    return ops::raw::all_reduce(x, {}, group).wait();
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return {grads[0], {}}; }
};

// ~~~ split / gather along a dim ~~~

struct SplitAlong : torch::autograd::Function<SplitAlong> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, const Group& group) {
    ctx->saved_data["dim"] = dim;
    save_group(ctx, group);
    return own_chunk(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather(grads[0], ctx->saved_data["dim"].toInt(), saved_group(ctx)), {}, {}};
  }
};

struct GatherAlong : torch::autograd::Function<GatherAlong> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, const Group& group) {
    ctx->saved_data["dim"] = dim;
    save_group(ctx, group);
    return all_gather(x, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {own_chunk(grads[0], ctx->saved_data["dim"].toInt(), saved_group(ctx)), {}, {}};
  }
};

// ~~~ sequence-parallel gather / reduce_scatter (dim 0) ~~~

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& group) {
    save_group(ctx, group);
    return all_gather(x, 0, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ops::raw::reduce_scatter(grads[0], ops::ReduceScatterOptions().dim(0), saved_group(ctx)).wait(), {}};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& group) {
    save_group(ctx, group);
    return ops::raw::reduce_scatter(x, ops::ReduceScatterOptions().dim(0), group).wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather(grads[0], 0, saved_group(ctx)), {}};
  }
};

// Resolves the group, checks x and `dim` and, for splits, divisibility by the group size.
Group prepare(const char* op, const at::Tensor& x, const Group& group, int64_t dim = 0, bool split = false) {
  Group g = resolve_tp_group(group, op);
  const int64_t d = detail::check_dim(op, g, x, dim);
  if (split) detail::check_divisible(op, g, x, d, g.size());
  return g;
}

}  // namespace

at::Tensor copy_to_tp_region(const at::Tensor& x, const Group& group) {
  Group g = prepare("copy_to_tp_region", x, group);
  if (g.size() == 1) return x;
  return CopyToRegion::apply(x, g);
}

at::Tensor reduce_from_tp_region(const at::Tensor& x, const Group& group) {
  Group g = prepare("reduce_from_tp_region", x, group);
  if (g.size() == 1) return x;
  return ReduceFromRegion::apply(x, g);
}

at::Tensor scatter_to_tp_region(const at::Tensor& x, const Group& group) {
  return detail::split_along(x, -1, group, "scatter_to_tp_region");
}

at::Tensor gather_from_tp_region(const at::Tensor& x, const Group& group) {
  return detail::gather_along(x, -1, group, "gather_from_tp_region");
}

at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, const Group& group) {
  return detail::split_along(x, 0, group, "scatter_to_sequence_parallel_region");
}

at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, const Group& group) {
  Group g = prepare("gather_from_sequence_parallel_region", x, group);
  if (g.size() == 1) return x;
  return GatherFromSequence::apply(x, g);
}

at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, const Group& group) {
  Group g = prepare("reduce_scatter_to_sequence_parallel_region", x, group, 0, /*split=*/true);
  if (g.size() == 1) return x;
  return ReduceScatterToSequence::apply(x, g);
}

namespace detail {

at::Tensor split_along(const at::Tensor& x, int64_t dim, const Group& group, const char* op) {
  Group g = prepare(op, x, group, dim, /*split=*/true);
  if (g.size() == 1) return x;
  return SplitAlong::apply(x, detail::check_dim(op, g, x, dim), g);
}

at::Tensor gather_along(const at::Tensor& x, int64_t dim, const Group& group, const char* op) {
  Group g = prepare(op, x, group, dim);
  if (g.size() == 1) return x;
  return GatherAlong::apply(x, detail::check_dim(op, g, x, dim), g);
}

}  // namespace detail
}  // namespace commgrad::tp
