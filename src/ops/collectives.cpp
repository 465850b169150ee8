// The differentiable collectives (ops/collectives.h, and their async forms
// of ops/async.h): one autograd Function per op, in the style of c10d's
// Functional.cpp. Each public op starts its raw collective
// (raw.cpp: checks, transport, workarounds) and hands the in-flight result to
// its Function, whose forward waits for it; the async forms do the same
// inside AsyncTensor::wait(), so the autograd node exists only once the
// transport has finished with the buffer. Backward runs the dual collective
// (docs/design.md, Family 1 table) through the same raw layer, so gradients get
// the same checks, debug fingerprints and Gloo workarounds as forward values.
//
// Deferred gradients. An op's backward only *starts* its gradient collective
// and returns; a second node, WaitForGradient, placed between the op's node
// and its input, waits for it and hands the gradient on. The engine runs
// ready nodes in decreasing sequence number and WaitForGradient has the
// lowest, so every other part of backward that is ready (other branches,
// weight gradients, other layers' collectives) runs while the collective is
// in flight, and nothing reads the gradient before it is complete.
//
// Non-tensor state (options) lives in ctx->saved_data; the group and the
// gradient in flight live in an OpState capsule shared with the
// WaitForGradient node. Backward returns one entry per forward argument.

#include "commgrad/ops/collectives.h"

#include "detail/tags.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/async.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace commgrad::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What an op's autograd node shares with its WaitForGradient node.
struct OpState : torch::CustomClassHolder {
  explicit OpState(Group g) : group(std::move(g)) {}
  Group group;
  bool deferred = false;                       // the input is routed through WaitForGradient
  at::Tensor placeholder;                      // stands for the gradient until it arrives
  raw::Pending grad;                           // the gradient collective in flight
  std::function<at::Tensor(at::Tensor)> post;  // local step once it arrived (may be empty)
};
using OpStatePtr = c10::intrusive_ptr<OpState>;

// An op's options, kept whole in ctx->saved_data.
template <class T>
struct Saved : torch::CustomClassHolder {
  explicit Saved(T v) : value(std::move(v)) {}
  T value;
};

// Waits for the gradient collective an op's backward started.
class WaitForGradient : public torch::autograd::Node {
 public:
  // Sequence number 0: the engine runs it only when nothing else is ready.
  explicit WaitForGradient(OpStatePtr state) : Node(/*sequence_nr=*/0), state_(std::move(state)) {}
  std::string name() const override { return "commgrad::WaitForGradient"; }

  variable_list apply(variable_list&& /*placeholder*/) override {
    OpState& s = *state_;
    if (!s.grad.defined()) return {at::Tensor()};
    at::Tensor g = s.grad.wait();
    s.grad = raw::Pending();
    if (s.post) g = s.post(g);
    s.post = nullptr;
    return {g};
  }

 private:
  OpStatePtr state_;
};

// x as the op's Function sees it: the same values, with a WaitForGradient
// between the op's node and x's own gradient edge.
at::Tensor route_through_wait(const at::Tensor& x, const OpStatePtr& state) {
  auto node = commgrad::detail::make_node<WaitForGradient>(state);
  node->add_next_edge(torch::autograd::impl::gradient_edge(x));
  at::Tensor routed = x.detach();
  torch::autograd::set_history(routed, node);
  state->placeholder = at::zeros({}, x.options()).expand(x.sizes());
  return routed;
}

void save_state(AutogradContext* ctx, const OpStatePtr& state) {
  ctx->saved_data["state"] = at::IValue::make_capsule(state);
}

OpState& saved_state(AutogradContext* ctx) {
  return *static_cast<OpState*>(ctx->saved_data["state"].toCapsule().get());
}

// Backward's result for an op whose gradient is `pending` (then `post`):
// the placeholder now, the gradient from WaitForGradient later; or, for an
// op that was not deferred, the gradient itself.
variable_list defer(AutogradContext* ctx, raw::Pending pending, std::function<at::Tensor(at::Tensor)> post = nullptr) {
  OpState& s = saved_state(ctx);
  if (!s.deferred) {
    at::Tensor g = pending.wait();
    return {post ? post(g) : g, {}, {}, {}};
  }
  s.grad = std::move(pending);
  s.post = std::move(post);
  return {s.placeholder, {}, {}, {}};
}

// The local step of an AVG gradient: the collective sums, this divides.
std::function<at::Tensor(at::Tensor)> divide_if_avg(ReduceOp op, int n) {
  if (op != ReduceOp::kAvg) return nullptr;
  return [n](at::Tensor g) { return g.div_(n); };
}

std::vector<int64_t> saved_ints(AutogradContext* ctx, const char* key) { return ctx->saved_data[key].toIntVector(); }

// Waits for the result and runs `apply(input, state)` when autograd needs a
// node (x requires grad, grad mode on). The gradient is deferred (x routed
// through a WaitForGradient) unless its collective will finish on the call
// anyway (small messages on shm), where the second node would cost more
// than it could overlap. A received gradient (`point_to_point`) is always
// deferred: it waits for a peer's backward.
template <typename Apply>
at::Tensor maybe_apply(const at::Tensor& x, raw::Pending& pending, const Group& group, Apply apply,
                       bool point_to_point = false) {
  const at::Tensor y = pending.wait();
  if (!(at::GradMode::is_enabled() && x.requires_grad())) return y;
  auto state = c10::make_intrusive<OpState>(group);
  // The dual collective moves at most twice the larger side (all_reduce MAX/MIN packs two).
  const int64_t bytes = 2 * std::max<int64_t>(x.nbytes(), y.defined() ? y.nbytes() : 0);
  state->deferred = point_to_point || !raw::completes_on_call(group, bytes);
  return apply(state->deferred ? route_through_wait(x, state) : x, state);
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
                            const OpStatePtr& state) {
    at::Tensor y = pending.wait();
    ctx->saved_data["op"] = static_cast<int64_t>(op);
    save_state(ctx, state);
    if (op == ReduceOp::kMax || op == ReduceOp::kMin) ctx->saved_data["mask"] = x.eq(y);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    const Group& group = saved_state(ctx).group;
    const at::Tensor& g = grads[0];
    COMMGRAD_CHECK(op != ReduceOp::kProduct, "all_reduce", group,
                   "PRODUCT has no gradient in commgrad (it is undefined where an input is zero); use it on "
                   "tensors that do not require grad, or reduce log-magnitudes with SUM");
    if (op == ReduceOp::kSum || op == ReduceOp::kAvg) {
      return defer(ctx, raw::all_reduce(g, AllReduceOptions().op(op), group));
    }
    // MAX/MIN: the summed gradient goes to the ranks holding the extremum,
    // split evenly between ties. One all_reduce carries both the gradients
    // and the holder counts.
    const at::Tensor mask = ctx->saved_data["mask"].toTensor();
    auto packed = at::cat({g.reshape({-1}), mask.reshape({-1}).to(g.scalar_type())});
    const int64_t m = g.numel();
    const auto sizes = g.sizes().vec();
    return defer(ctx, raw::all_reduce(packed, {}, group), [mask, m, sizes](at::Tensor summed) {
      auto total = summed.narrow(0, 0, m).view(sizes);
      auto holders = summed.narrow(0, m, m).view(sizes);
      return total * mask / holders;
    });
  }
};

at::Tensor finish_all_reduce(const at::Tensor& x, raw::Pending& p, const AllReduceOptions& o, const Group& g) {
  return maybe_apply(
      x, p, g, [&](const at::Tensor& routed, const OpStatePtr& s) { return AllReduceFn::apply(routed, p, o.op(), s); });
}

// ~~~ all_gather / reduce_scatter ~~~

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const AllGatherOptions& o, const OpStatePtr& state) {
    ctx->saved_data["dim"] = o.dim();
    ctx->saved_data["sizes"] = o.sizes();
    save_state(ctx, state);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto options = ReduceScatterOptions().dim(ctx->saved_data["dim"].toInt()).sizes(saved_ints(ctx, "sizes"));
    return defer(ctx, raw::reduce_scatter(grads[0], options, saved_state(ctx).group));
  }
};

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const ReduceScatterOptions& o, const OpStatePtr& state) {
    ctx->saved_data["dim"] = o.dim();
    ctx->saved_data["sizes"] = o.sizes();
    ctx->saved_data["op"] = static_cast<int64_t>(o.op());
    save_state(ctx, state);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group& group = saved_state(ctx).group;
    const auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    COMMGRAD_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "reduce_scatter", group, reduce_op_name(op),
                   " has no gradient in commgrad (differentiable: SUM, AVG)");
    auto options = AllGatherOptions().dim(ctx->saved_data["dim"].toInt()).sizes(saved_ints(ctx, "sizes"));
    return defer(ctx, raw::all_gather(grads[0], options, group), divide_if_avg(op, group.size()));
  }
};

// ~~~ broadcast / reduce ~~~

struct BroadcastFn : torch::autograd::Function<BroadcastFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending, int src,
                            const OpStatePtr& state) {
    ctx->saved_data["src"] = static_cast<int64_t>(src);
    save_state(ctx, state);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Reduce SUM to src; raw::reduce gives zeros to the other ranks.
    auto options = ReduceOptions().dst(static_cast<int>(ctx->saved_data["src"].toInt()));
    return defer(ctx, raw::reduce(grads[0], options, saved_state(ctx).group));
  }
};

struct ReduceFn : torch::autograd::Function<ReduceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const ReduceOptions& o, const OpStatePtr& state) {
    ctx->saved_data["dst"] = static_cast<int64_t>(o.dst());
    ctx->saved_data["op"] = static_cast<int64_t>(o.op());
    save_state(ctx, state);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group& group = saved_state(ctx).group;
    const auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    COMMGRAD_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "reduce", group, reduce_op_name(op),
                   " has no gradient in commgrad (differentiable: SUM, AVG; all_reduce also has MAX/MIN)");
    auto options = BroadcastOptions().src(static_cast<int>(ctx->saved_data["dst"].toInt()));
    return defer(ctx, raw::broadcast(grads[0], options, group), divide_if_avg(op, group.size()));
  }
};

// ~~~ scatter / gather ~~~

// Each is the other's gradient, with the same root and dim.
raw::Pending dual(const ScatterOptions& o, const at::Tensor& g, const Group& group) {
  return raw::gather(g, GatherOptions().dst(o.src()).dim(o.dim()), group);
}
raw::Pending dual(const GatherOptions& o, const at::Tensor& g, const Group& group) {
  return raw::scatter(g, ScatterOptions().src(o.dst()).dim(o.dim()), group);
}

template <class Options>
struct RootedFn : torch::autograd::Function<RootedFn<Options>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending, const Options& o,
                            const OpStatePtr& state) {
    ctx->saved_data["options"] = at::IValue::make_capsule(c10::make_intrusive<Saved<Options>>(o));
    save_state(ctx, state);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& o = static_cast<Saved<Options>*>(ctx->saved_data["options"].toCapsule().get())->value;
    return defer(ctx, dual(o, grads[0], saved_state(ctx).group));
  }
};
using ScatterFn = RootedFn<ScatterOptions>;
using GatherFn = RootedFn<GatherOptions>;

// ~~~ all_to_all ~~~

struct AllToAllFn : torch::autograd::Function<AllToAllFn> {
  // `o` has both split lists or neither (see complete_splits).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*x*/, raw::Pending& pending,
                            const AllToAllOptions& o, const OpStatePtr& state) {
    ctx->saved_data["dim"] = o.dim();
    ctx->saved_data["in"] = o.input_splits();
    ctx->saved_data["out"] = o.output_splits();
    save_state(ctx, state);
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The gradient travels back: what was received is sent, and vice versa.
    auto options = AllToAllOptions()
                       .dim(ctx->saved_data["dim"].toInt())
                       .input_splits(saved_ints(ctx, "out"))
                       .output_splits(saved_ints(ctx, "in"));
    return defer(ctx, raw::all_to_all(grads[0], options, saved_state(ctx).group));
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
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, raw::Pending& pending, const SendOptions& o,
                            const OpStatePtr& state) {
    pending.wait();
    ctx->saved_data["dst"] = static_cast<int64_t>(o.dst());
    ctx->saved_data["tag"] = static_cast<int64_t>(o.tag());
    ctx->saved_data["sizes"] = x.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    save_state(ctx, state);
    return at::zeros({}, x.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list /*grads*/) {
    return defer(ctx, detail::recv_gradient(saved_ints(ctx, "sizes"),
                                            static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()),
                                            static_cast<int>(ctx->saved_data["dst"].toInt()),
                                            static_cast<int>(ctx->saved_data["tag"].toInt()), saved_state(ctx).group));
  }
};

// The receiver's backward sends the gradient and has nothing to wait for
// afterwards, so it completes the send itself (errors surface in backward).
struct RecvFn : torch::autograd::Function<RecvFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*anchor*/, raw::Pending& pending,
                            const RecvOptions& o, const Group& group) {
    ctx->saved_data["src"] = static_cast<int64_t>(o.src());
    ctx->saved_data["tag"] = static_cast<int64_t>(o.tag());
    save_state(ctx, c10::make_intrusive<OpState>(group));
    return pending.wait();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::send_gradient(grads[0], static_cast<int>(ctx->saved_data["src"].toInt()),
                          static_cast<int>(ctx->saved_data["tag"].toInt()), saved_state(ctx).group)
        .wait();
    return {at::Tensor(), {}, {}, {}};
  }
};

// ~~~ finishing each op (shared by the sync and async forms) ~~~

// The finish of an op whose autograd function takes its options whole.
template <class Fn, class Options>
at::Tensor finish_with(const at::Tensor& x, raw::Pending& p, const Options& o, const Group& g) {
  return maybe_apply(x, p, g, [&](const at::Tensor& r, const OpStatePtr& s) { return Fn::apply(r, p, o, s); });
}

at::Tensor finish_broadcast(const at::Tensor& x, raw::Pending& p, const BroadcastOptions& o, const Group& g) {
  return maybe_apply(x, p, g,
                     [&](const at::Tensor& r, const OpStatePtr& s) { return BroadcastFn::apply(r, p, o.src(), s); });
}

at::Tensor finish_send(const at::Tensor& x, raw::Pending& p, const SendOptions& o, const Group& g) {
  if (!(at::GradMode::is_enabled() && x.requires_grad())) {
    p.wait();
    return at::zeros({}, x.options());
  }
  return maybe_apply(
      x, p, g, [&](const at::Tensor& r, const OpStatePtr& s) { return SendFn::apply(r, p, o, s); },
      /*point_to_point=*/true);
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
//
// Each op resolves its group once, starts the raw collective and finishes
// it now (sync) or inside AsyncTensor::wait() (async), under the grad mode
// of the call.

// The sync and async forms of an op that takes one tensor and its options.
#define COMMGRAD_SYNC_AND_ASYNC(name, Options, finish)                                        \
  at::Tensor name(const at::Tensor& x, const Options& options, const Group& group) {          \
    const Group g = raw::resolve_group(group);                                                \
    auto p = raw::name(x, options, g);                                                        \
    return finish(x, p, options, g);                                                          \
  }                                                                                           \
  AsyncTensor name##_async(const at::Tensor& x, const Options& options, const Group& group) { \
    const Group g = raw::resolve_group(group);                                                \
    return make_async(raw::name(x, options, g),                                               \
                      [x, options, g](raw::Pending& p) { return finish(x, p, options, g); }); \
  }

COMMGRAD_SYNC_AND_ASYNC(all_reduce, AllReduceOptions, finish_all_reduce)
COMMGRAD_SYNC_AND_ASYNC(all_gather, AllGatherOptions, finish_with<AllGatherFn>)
COMMGRAD_SYNC_AND_ASYNC(reduce_scatter, ReduceScatterOptions, finish_with<ReduceScatterFn>)
COMMGRAD_SYNC_AND_ASYNC(broadcast, BroadcastOptions, finish_broadcast)
COMMGRAD_SYNC_AND_ASYNC(reduce, ReduceOptions, finish_with<ReduceFn>)
COMMGRAD_SYNC_AND_ASYNC(scatter, ScatterOptions, finish_with<ScatterFn>)
COMMGRAD_SYNC_AND_ASYNC(gather, GatherOptions, finish_with<GatherFn>)
COMMGRAD_SYNC_AND_ASYNC(send, SendOptions, finish_send)
#undef COMMGRAD_SYNC_AND_ASYNC

at::Tensor all_to_all(const at::Tensor& x, const AllToAllOptions& options, const Group& group) {
  const Group g = raw::resolve_group(group);
  const auto o = complete_splits(options, g);
  auto p = raw::all_to_all(x, o, g);
  return finish_with<AllToAllFn>(x, p, o, g);
}

AsyncTensor all_to_all_async(const at::Tensor& x, const AllToAllOptions& options, const Group& group) {
  const Group g = raw::resolve_group(group);
  const auto o = complete_splits(options, g);
  return make_async(raw::all_to_all(x, o, g),
                    [x, o, g](raw::Pending& p) { return finish_with<AllToAllFn>(x, p, o, g); });
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
