// The raw collectives: checks, then one transport call, then a local step.
//
// Every op runs in the same order: local checks (nothing reaches the
// transport before they pass, because a failed Gloo call can leave the group
// unusable), the sequence number, the debug fingerprint, the single-rank
// short cut, then the transport. Buffers are made contiguous with exactly one
// copy where the transport needs it and none where the input already is and
// the transport only reads it.
//
// What Gloo (LibTorch 1.13) lacks, and how it is built here (costs in
// docs/benchmarks.md):
//   - AVG: SUM, then a local division by the group size.
//   - reduce_scatter (even and uneven): one alltoall_base that delivers to
//     each rank its part from every rank, then a local sum over the n parts.
//     Each rank sends and receives (n-1)/n of its input, the volume of a ring
//     reduce-scatter; an all_reduce followed by a slice would move twice that.
//   - all_gather with different sizes per rank: pad to the largest size,
//     all-gather, trim (volume n * max instead of the sum of the sizes).
//   - float16/bfloat16 reductions: reduced in float32 and cast back (Gloo has
//     no bfloat16; float32 also keeps the sum accurate), except on a transport
//     that accumulates them in float32 itself (shm). Data-movement ops
//     carry any dtype Gloo lacks as raw bytes, at no cost.
// Where the transport offers more than c10d's calls (out-of-place reductions,
// a native reduce-scatter, an all-gather into one tensor:
// Group::capabilities()), the ops use it.
// Ops along a dim other than 0 move that dim to the front first, so every
// rank's part is one contiguous block (one copy in, one copy out).

#include "detail/tags.h"

#include "detail/call.h"
#include "detail/checks.h"
#include "detail/fingerprint.h"
#include "detail/pending.h"
#include "detail/wire.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/process_group.h"
#include "commgrad/util/buffer_pool.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <numeric>

namespace commgrad::ops::raw {
namespace {

using commgrad::detail::WorkPtr;
using detail::Call;
using detail::check_dim;
using detail::check_divisible;
using detail::check_fingerprint;
using detail::check_peer;
using detail::check_sizes;
using detail::check_tensor;
using detail::CrossCheck;
using detail::reduce_wire;
using detail::wire;
using detail::wire_scale;

// Every buffer an op allocates (results, staging copies) comes from the
// buffer pool (util/buffer_pool.h): a training loop asks for the same sizes
// every step, and fresh large allocations cost a page fault per 4 KiB.

// t itself when contiguous, else a contiguous copy.
at::Tensor contiguous(const at::Tensor& t) { return t.is_contiguous() ? t : pooled_copy(t); }

// x with `dim` moved to the front, contiguous (a view when dim == 0 and x is contiguous).
at::Tensor front(const at::Tensor& x, int64_t dim) { return contiguous(dim == 0 ? x : x.movedim(dim, 0)); }

// Inverse of front(): a contiguous result with the front dim moved back to `dim`.
at::Tensor unfront(const at::Tensor& t, int64_t dim) { return dim == 0 ? t : contiguous(t.movedim(0, dim)); }

// Sizes of front(x) with the first dim replaced by `first`.
std::vector<int64_t> front_sizes(const at::Tensor& x, int64_t dim, int64_t first) {
  std::vector<int64_t> s{first};
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i != dim) s.push_back(x.size(i));
  }
  return s;
}

// Number of elements per index of dim `dim` (product of the other sizes).
int64_t inner_size(const at::Tensor& x, int64_t dim) {
  int64_t inner = 1;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i != dim) inner *= x.size(i);
  }
  return inner;
}

// Sizes of x with dim `dim` replaced by `size`.
std::vector<int64_t> with_dim(const at::Tensor& x, int64_t dim, int64_t size) {
  auto s = x.sizes().vec();
  s[dim] = size;
  return s;
}

std::vector<int64_t> equal_parts(int n, int64_t total) { return std::vector<int64_t>(n, total / n); }

std::vector<int64_t> scaled(const std::vector<int64_t>& v, int64_t factor) {
  std::vector<int64_t> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), [&](int64_t s) { return s * factor; });
  return out;
}

// The all_gather into `flat` ([n, per] in wire elements, contiguous) of `in`
// (flat wire view): the transport's own into one tensor where it has one,
// else Gloo's into a list of the n rows.
WorkPtr gather_all(const Call& call, at::Tensor flat_wire, at::Tensor in_wire) {
  if (const auto& native = call.capabilities(in_wire).all_gather) return native(flat_wire, in_wire, {});
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < call.size; ++r) outputs[0].push_back(flat_wire[r]);
  std::vector<at::Tensor> inputs{in_wire};
  return call.transport(in_wire).allgather(outputs, inputs);
}

// alltoall_base of flat wire buffers with counts in elements of the original dtype.
WorkPtr exchange(const Call& call, at::Tensor out_wire, at::Tensor in_wire, std::vector<int64_t> out_counts,
                 std::vector<int64_t> in_counts) {
  return call.transport(in_wire).alltoall_base(out_wire, in_wire, out_counts, in_counts);
}

}  // namespace

// ~~~ all_reduce ~~~

Pending all_reduce(const at::Tensor& x, const AllReduceOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("all_reduce", group);
  check_tensor(call, x);
  const auto dtype = detail::reduce_dtype(call, x, options.op());
  call.start(x);
  check_fingerprint(call, c10::str("all_reduce(", tensor_name(x), ", op=", options.op(), ")"));
  const auto out_dtype = x.scalar_type();
  const int n = call.size;
  const bool avg = options.op() == ReduceOp::kAvg;
  c10d::AllreduceOptions opts;
  opts.reduceOp = detail::to_c10d(options.op());
  const auto& reduce_out = call.capabilities(x).allreduce_out;
  if (reduce_out && n > 1 && dtype == out_dtype && x.is_contiguous() && x.numel() > 0) {
    // The transport reduces straight from the input into the result: no
    // staging copy, so the op costs what the raw in-place call costs.
    auto out = pooled_empty(x.sizes(), x.options());
    auto in_wire = reduce_wire(x);
    auto out_wire = reduce_wire(out);
    auto work = reduce_out(in_wire, out_wire, opts);
    return call.pending({work}, [out, n, avg]() mutable { return avg ? out.div_(n) : out; });
  }
  auto buffer = pooled_copy(x, dtype);
  auto finish = [buffer, out_dtype, n, avg]() mutable {
    if (avg && n > 1) buffer.div_(n);
    return buffer.scalar_type() == out_dtype ? buffer : pooled_copy(buffer, out_dtype);
  };
  if (call.size == 1 || x.numel() == 0) return call.ready(finish());
  std::vector<at::Tensor> tensors{reduce_wire(buffer)};
  return call.pending({call.transport(tensors[0]).allreduce(tensors, opts)}, finish);
}

Pending all_reduce_(at::Tensor& x, const AllReduceOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("all_reduce_", group);
  check_tensor(call, x);
  const auto dtype = detail::reduce_dtype(call, x, options.op());
  COMMGRAD_CHECK(x.is_contiguous(), call.op, call.group, "the in-place form needs a contiguous tensor, got ",
                 tensor_name(x), " with strides ", x.strides());
  call.start(x);
  check_fingerprint(call, c10::str("all_reduce(", tensor_name(x), ", op=", options.op(), ")"));
  at::Tensor target = x;
  // float16/bfloat16 on a transport that cannot reduce them in float32 goes
  // through a float32 copy, written back when done.
  at::Tensor buffer = dtype == x.scalar_type() ? target : pooled_copy(x, dtype);
  const int n = call.size;
  const bool avg = options.op() == ReduceOp::kAvg;
  auto finish = [target, buffer, n, avg]() mutable {
    if (avg && n > 1) buffer.div_(n);
    if (!buffer.is_same(target)) target.copy_(buffer);
    return target;
  };
  if (call.size == 1 || x.numel() == 0) return call.ready(finish());
  std::vector<at::Tensor> tensors{reduce_wire(buffer)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = detail::to_c10d(options.op());
  return call.pending({call.transport(tensors[0]).allreduce(tensors, opts)}, finish);
}

// ~~~ all_gather ~~~

Pending all_gather(const at::Tensor& x, const AllGatherOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("all_gather", group);
  check_tensor(call, x);
  const int64_t dim = check_dim(call, x, options.dim());
  const int n = call.size;
  std::vector<int64_t> sizes = options.sizes();
  const bool uneven = !sizes.empty();
  if (uneven) {
    check_sizes(call, "sizes", sizes, -1, x, dim);
    COMMGRAD_CHECK(sizes[call.rank] == x.size(dim), call.op, call.group, "sizes ", at::IntArrayRef(sizes),
                   " say this rank brings ", sizes[call.rank], " along dim ", dim, ", but its tensor is ",
                   tensor_name(x));
  } else {
    sizes.assign(n, x.size(dim));
  }
  call.start(x);
  check_fingerprint(
      call, c10::str("all_gather(", tensor_name(x, uneven ? dim : -1), ", dim=", dim, uneven ? ", sizes)" : ")"),
      uneven ? sizes : std::vector<int64_t>{}, {}, uneven ? CrossCheck::kEqualLists : CrossCheck::kNone);
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  const bool equal = std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == largest; });
  if (n == 1) return call.ready(pooled_copy(x));
  const int64_t inner = inner_size(x, dim);
  if (total * inner == 0) return call.ready(pooled_empty(with_dim(x, dim, total), x.options()));

  at::Tensor src = front(x, dim);
  if (!equal && x.size(dim) != largest) {  // pad to the largest part
    auto padded = pooled_empty(front_sizes(x, dim, largest), x.options()).zero_();
    padded.narrow(0, 0, x.size(dim)).copy_(src);
    src = padded;
  }
  auto flat = pooled_empty({n * src.numel()}, x.options());
  auto flat_wire = wire(flat).view({n, -1});
  auto work = gather_all(call, flat_wire, wire(src));
  auto fsizes = front_sizes(x, dim, largest);
  fsizes.insert(fsizes.begin(), n);  // [n, largest, rest...]
  return call.pending({work}, [flat, fsizes, sizes, equal, dim, n, total, x]() {
    auto parts = flat.view(fsizes);
    auto merged = fsizes;  // [total, rest...]
    merged.erase(merged.begin());
    merged[0] = total;
    if (equal) return unfront(parts.view(merged), dim);
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < n; ++r) pieces.push_back(parts[r].narrow(0, 0, sizes[r]));
    at::Tensor joined = pooled_empty(merged, parts.options());
    at::cat_out(joined, pieces, 0);
    return unfront(joined, dim);
  });
}

// ~~~ reduce_scatter ~~~

Pending reduce_scatter(const at::Tensor& x, const ReduceScatterOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("reduce_scatter", group);
  check_tensor(call, x);
  const int64_t dim = check_dim(call, x, options.dim());
  detail::reduce_dtype(call, x, options.op());
  const int n = call.size;
  std::vector<int64_t> sizes = options.sizes();
  const bool uneven = !sizes.empty();
  if (uneven) {
    check_sizes(call, "sizes", sizes, x.size(dim), x, dim);
  } else {
    check_divisible(call, x, dim);
    sizes = equal_parts(n, x.size(dim));
  }
  call.start(x);
  check_fingerprint(
      call,
      c10::str("reduce_scatter(", tensor_name(x), ", dim=", dim, ", op=", options.op(), uneven ? ", sizes)" : ")"),
      uneven ? sizes : std::vector<int64_t>{}, {}, uneven ? CrossCheck::kEqualLists : CrossCheck::kNone);
  const int64_t mine = sizes[call.rank];
  if (n == 1) return call.ready(pooled_copy(x));
  if (x.numel() == 0) return call.ready(at::zeros(with_dim(x, dim, mine), x.options()));

  const int64_t inner = inner_size(x, dim);
  const int64_t scale = wire_scale(x.scalar_type()) * inner;
  at::Tensor src = front(x, dim);
  const ReduceOp op = options.op();
  const auto& native = call.capabilities(x).reduce_scatter;
  if (native && !uneven && at::isFloatingType(x.scalar_type()) && op != ReduceOp::kProduct) {
    // The transport reduce-scatters natively: each rank reduces its own part
    // straight from the others' inputs (no all_to_all, no local sum).
    auto out = pooled_empty(front_sizes(x, dim, mine), x.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = detail::to_c10d(op);
    auto out_wire = reduce_wire(out);
    auto src_wire = reduce_wire(src);
    auto work = native(out_wire, src_wire, opts);
    return call.pending({work}, [out, op, dim, n]() mutable {
      if (op == ReduceOp::kAvg) out.div_(n);
      return unfront(out, dim);
    });
  }
  auto fsizes = front_sizes(x, dim, mine);
  fsizes.insert(fsizes.begin(), n);  // [n sources, mine, rest...]
  auto received = pooled_empty(fsizes, x.options());
  const bool even = !uneven;
  auto work = exchange(call, wire(received), wire(src),
                       even ? std::vector<int64_t>{} : scaled(std::vector<int64_t>(n, mine), scale),
                       even ? std::vector<int64_t>{} : scaled(sizes, scale));
  return call.pending({work}, [received, op, dim, n]() {
    at::Tensor r = pooled_empty(received.sizes().slice(1), received.options());
    switch (op) {
      case ReduceOp::kSum:
        at::sum_out(r, received, 0);
        break;
      case ReduceOp::kAvg:
        at::sum_out(r, received, 0).div_(n);
        break;
      case ReduceOp::kMax:
        at::amax_out(r, received, 0);
        break;
      case ReduceOp::kMin:
        at::amin_out(r, received, 0);
        break;
      case ReduceOp::kProduct:
        at::prod_out(r, received, 0);
        break;
    }
    return unfront(r, dim);
  });
}

// ~~~ broadcast, reduce ~~~

Pending broadcast(const at::Tensor& x, const BroadcastOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("broadcast", group);
  check_tensor(call, x);
  check_peer(call, "src", options.src());
  call.start(x);
  check_fingerprint(call, c10::str("broadcast(", tensor_name(x), ", src=", options.src(), ")"));
  const bool root = call.rank == options.src();
  auto buffer = root ? pooled_copy(x) : pooled_empty(x.sizes(), x.options());
  if (call.size == 1 || x.numel() == 0) return call.ready(buffer);
  std::vector<at::Tensor> tensors{wire(buffer)};
  c10d::BroadcastOptions opts;
  opts.rootRank = options.src();
  return call.pending({call.transport(tensors[0]).broadcast(tensors, opts)}, [buffer] { return buffer; });
}

Pending reduce(const at::Tensor& x, const ReduceOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("reduce", group);
  check_tensor(call, x);
  check_peer(call, "dst", options.dst());
  const auto dtype = detail::reduce_dtype(call, x, options.op());
  call.start(x);
  check_fingerprint(call, c10::str("reduce(", tensor_name(x), ", dst=", options.dst(), ", op=", options.op(), ")"));
  const bool root = call.rank == options.dst();
  const bool avg = options.op() == ReduceOp::kAvg;
  const auto out_dtype = x.scalar_type();
  const int n = call.size;
  c10d::ReduceOptions opts;
  opts.reduceOp = detail::to_c10d(options.op());
  opts.rootRank = options.dst();
  const auto& reduce_out = call.capabilities(x).reduce_out;
  if (reduce_out && n > 1 && dtype == out_dtype && x.is_contiguous() && x.numel() > 0) {
    // As all_reduce: the root reduces straight from the inputs into its result.
    auto out = pooled_empty(x.sizes(), x.options());
    auto in_wire = reduce_wire(x);
    auto out_wire = reduce_wire(out);
    auto work = reduce_out(in_wire, out_wire, opts);
    return call.pending({work}, [out, root, avg, n]() mutable {
      if (!root) return out.zero_();
      return avg ? out.div_(n) : out;
    });
  }
  auto buffer = pooled_copy(x, dtype);
  auto finish = [buffer, root, avg, out_dtype, n]() mutable {
    if (!root) return pooled_empty(buffer.sizes(), buffer.options().dtype(out_dtype)).zero_();
    if (avg && n > 1) buffer.div_(n);
    return buffer.scalar_type() == out_dtype ? buffer : pooled_copy(buffer, out_dtype);
  };
  if (call.size == 1 || x.numel() == 0) return call.ready(finish());
  std::vector<at::Tensor> tensors{reduce_wire(buffer)};
  return call.pending({call.transport(tensors[0]).reduce(tensors, opts)}, finish);
}

// ~~~ scatter, gather ~~~

Pending scatter(const at::Tensor& x, const ScatterOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("scatter", group);
  check_tensor(call, x);
  check_peer(call, "src", options.src());
  const int64_t dim = check_dim(call, x, options.dim());
  check_divisible(call, x, dim);
  call.start(x);
  check_fingerprint(call, c10::str("scatter(", tensor_name(x), ", src=", options.src(), ", dim=", dim, ")"));
  const int n = call.size;
  const int64_t part = x.size(dim) / n;
  if (n == 1) return call.ready(pooled_copy(x));
  auto out = pooled_empty(front_sizes(x, dim, part), x.options());
  if (x.numel() == 0) return call.ready(unfront(out, dim));
  std::vector<at::Tensor> outputs{wire(out)};
  std::vector<std::vector<at::Tensor>> inputs;
  if (call.rank == options.src()) {
    auto src = front(x, dim);
    inputs.emplace_back();
    for (int r = 0; r < n; ++r) inputs[0].push_back(wire(src.narrow(0, r * part, part)));
  }
  c10d::ScatterOptions opts;
  opts.rootRank = options.src();
  auto work = call.transport(x).scatter(outputs, inputs, opts);
  return call.pending({work}, [out, dim, inputs]() { return unfront(out, dim); });
}

Pending gather(const at::Tensor& x, const GatherOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("gather", group);
  check_tensor(call, x);
  check_peer(call, "dst", options.dst());
  const int64_t dim = check_dim(call, x, options.dim());
  call.start(x);
  check_fingerprint(call, c10::str("gather(", tensor_name(x), ", dst=", options.dst(), ", dim=", dim, ")"));
  const int n = call.size;
  const bool root = call.rank == options.dst();
  if (n == 1) return call.ready(pooled_copy(x));
  const auto full = with_dim(x, dim, x.size(dim) * n);
  if (x.numel() == 0) return call.ready(at::zeros(full, x.options()));
  auto src = front(x, dim);
  std::vector<at::Tensor> inputs{wire(src)};
  std::vector<std::vector<at::Tensor>> outputs;
  at::Tensor flat;
  if (root) {
    flat = pooled_empty({n * src.numel()}, x.options());
    auto flat_wire = wire(flat).view({n, -1});
    outputs.emplace_back();
    for (int r = 0; r < n; ++r) outputs[0].push_back(flat_wire[r]);
  }
  c10d::GatherOptions opts;
  opts.rootRank = options.dst();
  auto work = call.transport(x).gather(outputs, inputs, opts);
  auto fsizes = front_sizes(x, dim, x.size(dim) * n);
  return call.pending({work}, [flat, fsizes, full, root, dim, x, src]() {
    if (!root) return pooled_empty(full, x.options()).zero_();
    return unfront(flat.view(fsizes), dim);
  });
}

// ~~~ all_to_all ~~~

Pending all_to_all(const at::Tensor& x, const AllToAllOptions& options, const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("all_to_all", group);
  check_tensor(call, x);
  const int64_t dim = check_dim(call, x, options.dim());
  const int n = call.size;
  std::vector<int64_t> in_splits = options.input_splits();
  std::vector<int64_t> out_splits = options.output_splits();
  const bool even = in_splits.empty();
  COMMGRAD_CHECK(!(even && !out_splits.empty()), call.op, call.group, "output_splits ", at::IntArrayRef(out_splits),
                 " were given without input_splits; give both, only input_splits, or neither");
  if (even) {
    check_divisible(call, x, dim);
    in_splits = out_splits = equal_parts(n, x.size(dim));
  } else {
    check_sizes(call, "input_splits", in_splits, x.size(dim), x, dim);
    if (!out_splits.empty()) check_sizes(call, "output_splits", out_splits, -1, x, dim);
  }
  if (!even && out_splits.empty()) {  // learn what the others send: one small all_to_all of the counts
    auto counts = at::tensor(in_splits, at::kLong);
    auto received = all_to_all(counts, {}, call.group).wait();
    out_splits.assign(received.data_ptr<int64_t>(), received.data_ptr<int64_t>() + n);
  }
  call.start(x);
  check_fingerprint(call,
                    c10::str("all_to_all(", tensor_name(x, even ? -1 : dim), ", dim=", dim, even ? ")" : ", splits)"),
                    even ? std::vector<int64_t>{} : in_splits, even ? std::vector<int64_t>{} : out_splits,
                    even ? CrossCheck::kNone : CrossCheck::kTransposed);
  const int64_t total_out = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  if (n == 1) {
    COMMGRAD_CHECK(out_splits[0] == in_splits[0], call.op, call.group, "output_splits ", at::IntArrayRef(out_splits),
                   " do not match input_splits ", at::IntArrayRef(in_splits), " on a group of one rank");
    return call.ready(pooled_copy(x));
  }
  auto out = pooled_empty(front_sizes(x, dim, total_out), x.options());
  if (x.numel() == 0 && even) return call.ready(unfront(out, dim));
  const int64_t per_row = inner_size(x, dim);
  if (per_row == 0) return call.ready(unfront(out, dim));  // nothing to move on any rank
  const int64_t scale = wire_scale(x.scalar_type()) * per_row;
  auto src = front(x, dim);
  auto work = exchange(call, wire(out), wire(src), even ? std::vector<int64_t>{} : scaled(out_splits, scale),
                       even ? std::vector<int64_t>{} : scaled(in_splits, scale));
  return call.pending({work}, [out, dim, src]() { return unfront(out, dim); });
}

// ~~~ send, recv, barrier ~~~

namespace {

// Debug mode: a send's or recv's Pending waits for the header and (a recv)
// checks it before it waits for the message (`work`, none for an empty one)
// and returns `result`; `keep` stays alive until then (the send's buffer).
Pending checked_p2p(const Call& call, const std::shared_ptr<detail::P2pHeader>& header,
                    const commgrad::detail::WorkPtr& work, at::Tensor result, at::Tensor keep = at::Tensor()) {
  const auto posted = detail::Clock::now();
  return call.pending(header->works, [call, header, work, result, keep, posted]() {
    auto wait_message = [&] {
      if (work) detail::wait_step(call.op, call.group, call.sequence, call.record, work, posted);
    };
    try {
      header->verify();
    } catch (const std::exception&) {
      // A mismatch: take the message off the wire when its bytes fit (the
      // pair's next messages then arrive as they should), then say so.
      try {
        wait_message();
      } catch (const std::exception&) {
      }
      throw;
    }
    wait_message();
    return result;
  });
}

// send/recv with the tag that goes on the wire (user tags, or the gradient
// tag space used by the differentiable pair's backward).
Pending send_tagged(const at::Tensor& x, const SendOptions& options, const Group& group, int wire_tag) {
  at::NoGradGuard no_grad;
  Call call("send", group);
  check_tensor(call, x);
  check_peer(call, "dst", options.dst());
  COMMGRAD_CHECK(options.dst() != call.rank, call.op, call.group, "dst ", options.dst(), " is this rank itself");
  const auto header =
      detail::post_p2p_header(call, options.dst(), wire_tag, true, x.sizes(), x.scalar_type(), x.requires_grad());
  if (x.numel() == 0)
    return header ? checked_p2p(call, header, commgrad::detail::WorkPtr(), at::Tensor()) : call.ready(at::Tensor());
  auto buffer = contiguous(x);
  std::vector<at::Tensor> tensors{wire(buffer)};
  auto work = call.transport(tensors[0]).send(tensors, options.dst(), wire_tag);
  if (header) return checked_p2p(call, header, work, at::Tensor(), buffer);
  return call.pending({work}, [buffer]() { return at::Tensor(); });
}

Pending recv_tagged(at::IntArrayRef sizes, const RecvOptions& options, const Group& group, int wire_tag) {
  at::NoGradGuard no_grad;
  Call call("recv", group);
  check_peer(call, "src", options.src());
  COMMGRAD_CHECK(options.src() != call.rank, call.op, call.group, "src ", options.src(), " is this rank itself");
  for (int64_t s : sizes) COMMGRAD_CHECK(s >= 0, call.op, call.group, "sizes ", sizes, " has a negative entry");
  COMMGRAD_CHECK(!options.requires_grad() || at::isFloatingType(options.dtype()) || at::isComplexType(options.dtype()),
                 call.op, call.group, "requires_grad(true) needs a floating-point dtype, got ",
                 c10::toString(options.dtype()), " (integer tensors cannot have gradients)");
  const auto header =
      detail::post_p2p_header(call, options.src(), wire_tag, false, sizes, options.dtype(), options.requires_grad());
  auto buffer = pooled_empty(sizes, at::TensorOptions().dtype(options.dtype()));
  if (buffer.numel() == 0)
    return header ? checked_p2p(call, header, commgrad::detail::WorkPtr(), buffer) : call.ready(buffer);
  std::vector<at::Tensor> tensors{wire(buffer)};
  auto work = call.transport(tensors[0]).recv(tensors, options.src(), wire_tag);
  if (header) return checked_p2p(call, header, work, buffer);
  return call.pending({work}, [buffer]() { return buffer; });
}

void check_user_tag(const char* op, const Group& group, int tag) {
  COMMGRAD_CHECK(tag >= 0 && tag < detail::kMaxUserTag, op, raw::resolve_group(group), "tag ", tag, " is outside 0..",
                 detail::kMaxUserTag - 1);
}

}  // namespace

Pending send(const at::Tensor& x, const SendOptions& options, const Group& group) {
  check_user_tag("send", group, options.tag());
  return send_tagged(x, options, group, options.tag());
}

Pending recv(at::IntArrayRef sizes, const RecvOptions& options, const Group& group) {
  check_user_tag("recv", group, options.tag());
  return recv_tagged(sizes, options, group, options.tag());
}

Group resolve_group(const Group& group) { return group.defined() ? group : world(); }

bool completes_on_call(const Group& group, int64_t bytes) {
  const Group g = resolve_group(group);
  return g.size() == 1 || bytes < g.capabilities().completes_on_call_below;
}

}  // namespace commgrad::ops::raw

namespace commgrad::ops::detail {

raw::Pending send_gradient(const at::Tensor& grad, int dst, int tag, const Group& group) {
  return raw::send_tagged(grad, SendOptions(dst), group, kGradTagBase + tag);
}

raw::Pending recv_gradient(at::IntArrayRef sizes, at::ScalarType dtype, int src, int tag, const Group& group) {
  return raw::recv_tagged(sizes, RecvOptions(src).dtype(dtype), group, kGradTagBase + tag);
}

}  // namespace commgrad::ops::detail

namespace commgrad::ops::raw {

Pending barrier(const Group& group) {
  at::NoGradGuard no_grad;  // raw ops build no autograd graph
  Call call("barrier", group);
  call.start();
  check_fingerprint(call, "barrier()");
  if (call.size == 1) return call.ready(at::Tensor());
  return call.pending({call.group.transport().barrier()}, nullptr);
}

}  // namespace commgrad::ops::raw
