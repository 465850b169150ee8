// The differentiable collectives: one autograd Function per op, in the
// style of c10d's Functional.cpp. Each public op starts its raw collective
// (raw.cpp: checks, transport, workarounds) and hands the in-flight result to
// its Function, whose forward waits for it; the async forms do the same
// inside AsyncTensor::wait(), so the autograd node exists only once the
// transport has finished with the buffer. Backward runs the dual collective
// (DESIGN.md, Family 1 table) through the same raw layer, so gradients get
// the same checks, debug fingerprints and Gloo workarounds as forward values.
//
// Non-tensor state (options, the group) lives in ctx->saved_data; the group
// travels in a capsule. Backward returns one entry per forward argument.

#include "detail/common.h"

#include "commgrad/ops/async.h"
#include "commgrad/ops/collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace commgrad::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(Group g) : group(std::move(g)) {}
  Group group;
};

void save_group(AutogradContext* ctx, const Group& group) {
  ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
}

Group saved_group(AutogradContext* ctx) {
  auto capsule = ctx->saved_data["group"].toCapsule();
  return static_cast<GroupCapsule*>(capsule.get())->group;
}

std::vector<int64_t> saved_ints(AutogradContext* ctx, const char* key) {
  return ctx->saved_data[key].toIntVector();
}

// Runs `apply` only when autograd needs a node (x requires grad, grad mode on).
template <typename Apply>
at::Tensor maybe_apply(const at::Tensor& x, raw::Pending& pending, Apply apply) {
  if (!(at::GradMode::is_enabled() && x.requires_grad())) return pending.wait();
  return apply();
}

// The AsyncTensor of an op: `finish(pending)` under the grad mode of the call.
AsyncTensor make_async(raw::Pending pending, std::function<at::Tensor(raw::Pending&)> finish) {
  const bool grad_mode = at::GradMode::is_enabled();
  return AsyncTensor(std::move(pending), [grad_mode, finish = std::move(finish)](raw::Pending& p) {
    at::AutoGradMode mode(grad_mode);
    return finish(p);
  });
}

// ~~~ all_reduce ~~~

struct AllReduceFn : torch::autograd::Function<AllReduceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, raw::Pending& pending, ReduceOp op,
                            const Group& group) {
    at::Tensor y = pending.wait();
    ctx->saved_data["op"] = static_cast<int64_t>(op);
    save_group(ctx, group);
    if (op == ReduceOp::kMax || op == ReduceOp::kMin) ctx->saved_data["mask"] = x.eq(y);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    const Group group = saved_group(ctx);
    const at::Tensor& g = grads[0];
    COMMGRAD_CHECK(op != ReduceOp::kProduct, "all_reduce", group,
                   "PRODUCT has no gradient in commgrad (it is undefined where an input is zero); use it on "
                   "tensors that do not require grad, or reduce log-magnitudes with SUM");
    if (op == ReduceOp::kSum || op == ReduceOp::kAvg) {
      return {raw::all_reduce(g, AllReduceOptions().op(op), group).wait(), {}, {}, {}};
    }
    // MAX/MIN: the summed gradient goes to the ranks holding the extremum,
    // split evenly between ties. One all_reduce carries both the gradients
    // and the holder counts.
    const at::Tensor mask = ctx->saved_data["mask"].toTensor();
    auto packed = at::cat({g.reshape({-1}), mask.reshape({-1}).to(g.scalar_type())});
    auto summed = raw::all_reduce(packed, {}, group).wait();
    const int64_t m = g.numel();
    auto total = summed.narrow(0, 0, m).view(g.sizes());
    auto holders = summed.narrow(0, m, m).view(g.sizes());
    return {total * mask / holders, {}, {}, {}};
  }
};

at::Tensor finish_all_reduce(const at::Tensor& x, raw::Pending& p, const AllReduceOptions& o, const Group& g) {
  return maybe_apply(x, p, [&] { return AllReduceFn::apply(x, p, o.op(), g); });
}

// ~~~ all_gather / reduce_scatter ~~~

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const AllGatherOptions& o, const Group& group) {
    ctx->saved_data["dim"] = o.dim();
    ctx->saved_data["sizes"] = o.sizes();
    save_group(ctx, group);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto options = ReduceScatterOptions().dim(ctx->saved_data["dim"].toInt()).sizes(saved_ints(ctx, "sizes"));
    return {raw::reduce_scatter(grads[0], options, saved_group(ctx)).wait(), {}, {}, {}};
  }
};

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const ReduceScatterOptions& o, const Group& group) {
    ctx->saved_data["dim"] = o.dim();
    ctx->saved_data["sizes"] = o.sizes();
    ctx->saved_data["op"] = static_cast<int64_t>(o.op());
    save_group(ctx, group);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group group = saved_group(ctx);
    const auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    COMMGRAD_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "reduce_scatter", group, reduce_op_name(op),
                   " has no gradient in commgrad (differentiable: SUM, AVG)");
    auto options = AllGatherOptions().dim(ctx->saved_data["dim"].toInt()).sizes(saved_ints(ctx, "sizes"));
    auto gathered = raw::all_gather(grads[0], options, group).wait();
    if (op == ReduceOp::kAvg) gathered.div_(group.size());
    return {gathered, {}, {}, {}};
  }
};

// ~~~ broadcast / reduce ~~~

struct BroadcastFn : torch::autograd::Function<BroadcastFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending, int src,
                            const Group& group) {
    ctx->saved_data["src"] = static_cast<int64_t>(src);
    save_group(ctx, group);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Reduce SUM to src; raw::reduce gives zeros to the other ranks.
    auto options = ReduceOptions().dst(static_cast<int>(ctx->saved_data["src"].toInt()));
    return {raw::reduce(grads[0], options, saved_group(ctx)).wait(), {}, {}, {}};
  }
};

struct ReduceFn : torch::autograd::Function<ReduceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const ReduceOptions& o, const Group& group) {
    ctx->saved_data["dst"] = static_cast<int64_t>(o.dst());
    ctx->saved_data["op"] = static_cast<int64_t>(o.op());
    save_group(ctx, group);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group group = saved_group(ctx);
    const auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    COMMGRAD_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "reduce", group, reduce_op_name(op),
                   " has no gradient in commgrad (differentiable: SUM, AVG; all_reduce also has MAX/MIN)");
    auto options = BroadcastOptions().src(static_cast<int>(ctx->saved_data["dst"].toInt()));
    auto g = raw::broadcast(grads[0], options, group).wait();
    if (op == ReduceOp::kAvg) g.div_(group.size());
    return {g, {}, {}, {}};
  }
};

// ~~~ scatter / gather ~~~

struct ScatterFn : torch::autograd::Function<ScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const ScatterOptions& o, const Group& group) {
    ctx->saved_data["src"] = static_cast<int64_t>(o.src());
    ctx->saved_data["dim"] = o.dim();
    save_group(ctx, group);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto options = GatherOptions()
                       .dst(static_cast<int>(ctx->saved_data["src"].toInt()))
                       .dim(ctx->saved_data["dim"].toInt());
    return {raw::gather(grads[0], options, saved_group(ctx)).wait(), {}, {}, {}};
  }
};

struct GatherFn : torch::autograd::Function<GatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const GatherOptions& o, const Group& group) {
    ctx->saved_data["dst"] = static_cast<int64_t>(o.dst());
    ctx->saved_data["dim"] = o.dim();
    save_group(ctx, group);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto options = ScatterOptions()
                       .src(static_cast<int>(ctx->saved_data["dst"].toInt()))
                       .dim(ctx->saved_data["dim"].toInt());
    return {raw::scatter(grads[0], options, saved_group(ctx)).wait(), {}, {}, {}};
  }
};

// ~~~ all_to_all ~~~

struct AllToAllFn : torch::autograd::Function<AllToAllFn> {
  // `o` has both split lists or neither (see complete_splits).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const AllToAllOptions& o, const Group& group) {
    ctx->saved_data["dim"] = o.dim();
    ctx->saved_data["in"] = o.input_splits();
    ctx->saved_data["out"] = o.output_splits();
    save_group(ctx, group);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The gradient travels back: what was received is sent, and vice versa.
    auto options = AllToAllOptions()
                       .dim(ctx->saved_data["dim"].toInt())
                       .input_splits(saved_ints(ctx, "out"))
                       .output_splits(saved_ints(ctx, "in"));
    return {raw::all_to_all(grads[0], options, saved_group(ctx)).wait(), {}, {}, {}};
  }
};

// With only input splits given, learns the output splits first (one small
// all_to_all of the counts), so that backward knows both.
AllToAllOptions complete_splits(AllToAllOptions o, const Group& g) {
  if (o.input_splits().empty() || !o.output_splits().empty()) return o;
  if (static_cast<int>(o.input_splits().size()) != g.size()) return o;  // raw::all_to_all reports it
  auto counts = raw::all_to_all(at::tensor(o.input_splits(), at::kLong), {}, g).wait();
  return o.output_splits(std::vector<int64_t>(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + g.size()));
}

// ~~~ send / recv ~~~

struct SendFn : torch::autograd::Function<SendFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, raw::Pending& pending,
                            const SendOptions& o, const Group& group) {
    pending.wait();
    ctx->saved_data["dst"] = static_cast<int64_t>(o.dst());
    ctx->saved_data["tag"] = static_cast<int64_t>(o.tag());
    ctx->saved_data["sizes"] = x.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    save_group(ctx, group);
    return at::zeros({}, x.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list /*grads*/) {
    auto grad = detail::recv_gradient(saved_ints(ctx, "sizes"),
                                      static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()),
                                      static_cast<int>(ctx->saved_data["dst"].toInt()),
                                      static_cast<int>(ctx->saved_data["tag"].toInt()), saved_group(ctx));
    return {grad.wait(), {}, {}, {}};
  }
};

struct RecvFn : torch::autograd::Function<RecvFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*anchor*/, raw::Pending& pending,
                            const RecvOptions& o, const Group& group) {
    ctx->saved_data["src"] = static_cast<int64_t>(o.src());
    ctx->saved_data["tag"] = static_cast<int64_t>(o.tag());
    save_group(ctx, group);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::send_gradient(grads[0], static_cast<int>(ctx->saved_data["src"].toInt()),
                          static_cast<int>(ctx->saved_data["tag"].toInt()), saved_group(ctx))
        .wait();
    return {at::Tensor(), {}, {}, {}};
  }
};

// ~~~ finishing each op (shared by the sync and async forms) ~~~

#define COMMGRAD_FINISH(name, Fn, Options)                                                           \
  at::Tensor finish_##name(const at::Tensor& x, raw::Pending& p, const Options& o, const Group& g) { \
    return maybe_apply(x, p, [&] { return Fn::apply(x, p, o, g); });                                 \
  }
COMMGRAD_FINISH(all_gather, AllGatherFn, AllGatherOptions)
COMMGRAD_FINISH(reduce_scatter, ReduceScatterFn, ReduceScatterOptions)
COMMGRAD_FINISH(reduce, ReduceFn, ReduceOptions)
COMMGRAD_FINISH(scatter, ScatterFn, ScatterOptions)
COMMGRAD_FINISH(gather, GatherFn, GatherOptions)
COMMGRAD_FINISH(all_to_all, AllToAllFn, AllToAllOptions)
COMMGRAD_FINISH(send_token, SendFn, SendOptions)
#undef COMMGRAD_FINISH

at::Tensor finish_broadcast(const at::Tensor& x, raw::Pending& p, const BroadcastOptions& o, const Group& g) {
  return maybe_apply(x, p, [&] { return BroadcastFn::apply(x, p, o.src(), g); });
}

at::Tensor finish_send(const at::Tensor& x, raw::Pending& p, const SendOptions& o, const Group& g) {
  if (!(at::GradMode::is_enabled() && x.requires_grad())) {
    p.wait();
    return at::zeros({}, x.options());
  }
  return finish_send_token(x, p, o, g);
}

at::Tensor finish_recv(raw::Pending& p, const RecvOptions& o, const Group& g) {
  if (!(at::GradMode::is_enabled() && o.requires_grad())) return p.wait();
  // The received tensor has no tensor input: a 0-element anchor that requires
  // grad gives its autograd node a place in the graph.
  auto anchor = at::empty({0}, at::TensorOptions().dtype(o.dtype())).requires_grad_(true);
  return RecvFn::apply(anchor, p, o, g);
}

}  // namespace

// ~~~ public ops ~~~

#define COMMGRAD_DEFINE_OP(name, Options)                                                             \
  at::Tensor name(const at::Tensor& x, const Options& options, const Group& group) {                 \
    const Group g = raw::resolve_group(group);                                                        \
    auto p = raw::name(x, options, g);                                                                \
    return finish_##name(x, p, options, g);                                                           \
  }                                                                                                   \
  AsyncTensor name##_async(const at::Tensor& x, const Options& options, const Group& group) {        \
    const Group g = raw::resolve_group(group);                                                        \
    return make_async(raw::name(x, options, g),                                                       \
                      [x, options, g](raw::Pending& p) { return finish_##name(x, p, options, g); }); \
  }
COMMGRAD_DEFINE_OP(all_reduce, AllReduceOptions)
COMMGRAD_DEFINE_OP(all_gather, AllGatherOptions)
COMMGRAD_DEFINE_OP(reduce_scatter, ReduceScatterOptions)
COMMGRAD_DEFINE_OP(broadcast, BroadcastOptions)
COMMGRAD_DEFINE_OP(reduce, ReduceOptions)
COMMGRAD_DEFINE_OP(scatter, ScatterOptions)
COMMGRAD_DEFINE_OP(gather, GatherOptions)
COMMGRAD_DEFINE_OP(send, SendOptions)
#undef COMMGRAD_DEFINE_OP

at::Tensor all_to_all(const at::Tensor& x, const AllToAllOptions& options, const Group& group) {
  const Group g = raw::resolve_group(group);
  const auto o = complete_splits(options, g);
  auto p = raw::all_to_all(x, o, g);
  return finish_all_to_all(x, p, o, g);
}

AsyncTensor all_to_all_async(const at::Tensor& x, const AllToAllOptions& options, const Group& group) {
  const Group g = raw::resolve_group(group);
  const auto o = complete_splits(options, g);
  return make_async(raw::all_to_all(x, o, g), [x, o, g](raw::Pending& p) { return finish_all_to_all(x, p, o, g); });
}

at::Tensor recv(at::IntArrayRef sizes, const RecvOptions& options, const Group& group) {
  const Group g = raw::resolve_group(group);
  auto p = raw::recv(sizes, options, g);
  return finish_recv(p, options, g);
}

AsyncTensor recv_async(at::IntArrayRef sizes, const RecvOptions& options, const Group& group) {
  const Group g = raw::resolve_group(group);
  return make_async(raw::recv(sizes, options, g), [options, g](raw::Pending& p) { return finish_recv(p, options, g); });
}

void barrier(const Group& group) { raw::barrier(group).wait(); }

Handle barrier_async(const Group& group) { return Handle(raw::barrier(group)); }

}  // namespace commgrad::ops
