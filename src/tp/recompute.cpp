// Activation recomputation.
//
// Forward. recompute() snapshots the random streams fn may draw from, runs
// fn under NoGradGuard, checks that fn left its inputs alone (version
// counters), and gives the floating-point outputs one RecomputeBackward node
// whose next edges are the inputs' and the declared parameters' gradient
// edges. What stays alive until backward: aliases of the inputs (no copy),
// the function, the snapshot (a few KiB: one CPU generator state per
// stream) and the outputs' shapes. fn's activations are freed as soon as it
// returns.
//
// Backward. The node checks the inputs' version counters again, snapshots
// the streams as they are now, restores the forward's, makes the forward's
// tracker this thread's (backward may run on another thread) and re-enters
// the fork fn ran under, reruns fn with grad on detached copies of the
// inputs (requires_grad as the originals), puts the streams back, and
// compares the outputs with the forward's. Then one nested engine call,
// torch::autograd::grad(), back-propagates the incoming gradients through
// the rerun's graph to the detached inputs, the declared parameters and any
// other leaf found in that graph. Gradients of inputs and declared
// parameters are returned to the outer engine, which accumulates them (with
// their hooks, in the outer graph task); other leaves are accumulated by a
// second, tiny engine call on those leaves (their AccumulateGrad nodes run,
// hooks included, inside it).
//
// Zero-bubble schedules (weight_gradients.h). A forward under
// DeferWeightGradients runs fn without grad: its linear layers count
// themselves as deferring (so the pipeline knows the stage defers), but no
// backward of theirs will run from it. The rerun runs under the same queue
// (the forward's, saved in the state), so the rerun's linear layers leave
// their weight gradients there for W, exactly as they would have without
// recompute, and the nested engine call returns no gradient for those
// weights.
//
// Cost: one more forward of fn per backward (the closed form of the tests:
// backward matmuls + forward matmuls), and no extra collective beyond those
// fn itself issues.

#include "commgrad/tp/recompute.h"

#include "commgrad/detail/torch_compat.h"
#include "commgrad/tp/weight_gradients.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <utility>

namespace commgrad::tp {
namespace {

using torch::autograd::variable_list;

// ~~~ random streams ~~~

at::Tensor generator_state(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(at::Generator generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Every stream fn may draw from, at one moment.
struct RngSnapshot {
  at::Tensor cpu;                                          // LibTorch's default CPU generator
  RngTracker tracker;                                      // this thread's tracker when captured
  RngStates tracker_states;                                // its streams
  std::optional<std::string> fork;                         // the stream forked then, if any
  std::vector<std::pair<at::Device, at::Tensor>> devices;  // default CUDA generators
};

std::optional<std::string> forked_stream(const RngTracker& tracker) {
  const at::Generator current = tracker.current_generator();
  if (current == tracker.default_generator()) return std::nullopt;
  for (const auto& name : tracker.names()) {
    if (current == tracker.generator(name)) return name;
  }
  return std::nullopt;
}

RngSnapshot capture_rng(const RngTracker& tracker, const std::vector<at::Device>& devices) {
  RngSnapshot s;
  s.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  s.tracker = tracker;
  s.tracker_states = tracker.get_states();
  s.fork = forked_stream(tracker);
  for (const auto& device : devices) {
    s.devices.emplace_back(device, generator_state(at::globalContext().defaultGenerator(device)));
  }
  return s;
}

void restore_rng(RngSnapshot& s) {
  set_generator_state(at::detail::getDefaultCPUGenerator(), s.cpu);
  s.tracker.set_states(s.tracker_states);
  for (const auto& [device, state] : s.devices) {
    set_generator_state(at::globalContext().defaultGenerator(device), state);
  }
}

// While it lives, the streams are as they were in forward and the forward's
// tracker (and fork) is this thread's; then everything is put back.
class RngReplay {
 public:
  explicit RngReplay(RngSnapshot& forward, const std::vector<at::Device>& devices)
      : now_(capture_rng(forward.tracker, devices)), scoped_(forward.tracker) {
    restore_rng(forward);
    if (forward.fork) fork_.emplace(forward.tracker.fork(*forward.fork));
  }
  ~RngReplay() {
    fork_.reset();
    try {
      restore_rng(now_);
    } catch (...) {  // a destructor must not throw; the streams were valid a moment ago
    }
  }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  RngSnapshot now_;
  ScopedRngTracker scoped_;
  std::optional<RngFork> fork_;
};

std::vector<at::Device> cuda_devices(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Device> devices;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.is_cuda()) continue;
    if (std::find(devices.begin(), devices.end(), t.device()) == devices.end()) devices.push_back(t.device());
  }
  return devices;
}

// While it lives, this thread's linear layers defer their weight gradients
// into `queue` (the one the forward ran under; null: none), as they did in
// the forward: under a zero-bubble schedule the rerun's weight gradients
// then wait for W, as they would without recompute.
class DeferralReplay {
 public:
  explicit DeferralReplay(std::shared_ptr<WeightGradients::Queue> queue)
      : previous_(detail::exchange_deferring_weight_gradients(std::move(queue))) {}
  ~DeferralReplay() { detail::exchange_deferring_weight_gradients(std::move(previous_)); }
  DeferralReplay(const DeferralReplay&) = delete;
  DeferralReplay& operator=(const DeferralReplay&) = delete;

 private:
  std::shared_ptr<WeightGradients::Queue> previous_;
};

// ~~~ what forward keeps ~~~

struct OutputMeta {
  bool defined = false;
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  std::optional<size_t> node_input;  // index among the node's inputs when attached
  at::Tensor checksum;               // check_rerun: the forward's sum (floating-point outputs)
};

// One read of a floating-point output: its sum, in at least float32.
at::Tensor checksum(const at::Tensor& o) {
  at::NoGradGuard no_grad;
  return o.detach().sum(at::promote_types(o.scalar_type(), at::kFloat)).cpu();
}

// Bit for bit (a NaN equals a NaN).
bool same_checksum(const at::Tensor& a, const at::Tensor& b) {
  const double x = a.item<double>(), y = b.item<double>();
  return x == y || (std::isnan(x) && std::isnan(y));
}

struct State {
  RecomputeFunction fn;
  std::string name;
  std::vector<at::Tensor> inputs;  // detached aliases: same storage and version counter
  std::vector<int64_t> versions;
  std::vector<char> needs_grad;
  std::vector<at::Tensor> parameters;  // declared, deduplicated, not among the inputs
  bool preserve_rng = true;
  RngSnapshot rng;
  std::vector<at::Device> devices;
  std::shared_ptr<WeightGradients::Queue> deferral;  // the forward's DeferWeightGradients queue, if any
  std::vector<OutputMeta> outputs;
  size_t attached = 0;
};

std::string prefix(const std::string& name) { return "[commgrad] recompute '" + name + "': "; }

void check_versions(const State& s, const char* when) {
  for (size_t i = 0; i < s.inputs.size(); ++i) {
    if (!s.inputs[i].defined()) continue;
    const int64_t now = s.inputs[i]._version();
    TORCH_CHECK(now == s.versions[i], prefix(s.name), "input ", i, " (", tensor_name(s.inputs[i]),
                ") was modified in place ", when, " (version ", s.versions[i], " -> ", now,
                "); a recomputed function must see the values of its forward. Modify a clone, or do the in-place "
                "update outside recompute");
  }
}

void check_outputs(const State& s, const std::vector<at::Tensor>& rerun) {
  TORCH_CHECK(rerun.size() == s.outputs.size(), prefix(s.name), "the function returned ", s.outputs.size(),
              " outputs in forward and ", rerun.size(), " when recomputed");
  for (size_t i = 0; i < rerun.size(); ++i) {
    const OutputMeta& m = s.outputs[i];
    const at::Tensor& o = rerun[i];
    TORCH_CHECK(o.defined() == m.defined, prefix(s.name), "output ", i, " was ", m.defined ? "" : "un",
                "defined in forward and is ", o.defined() ? "" : "un", "defined when recomputed");
    if (!o.defined()) continue;
    TORCH_CHECK(o.sizes().vec() == m.sizes && o.scalar_type() == m.dtype && o.device() == m.device, prefix(s.name),
                "output ", i, " was ", dtype_name(m.dtype), shape_name(m.sizes), " on ", m.device.str(),
                " in forward and is ", tensor_name(o), " on ", o.device().str(),
                " when recomputed (does the function depend on state that changed since forward?)");
    if (!m.checksum.defined()) continue;
    const at::Tensor now = checksum(o);
    TORCH_CHECK(same_checksum(now, m.checksum), prefix(s.name), "output ", i, " (", tensor_name(o),
                ") differs when recomputed (its sum was ", m.checksum.item<double>(), " in forward and is ",
                now.item<double>(),
                " in the rerun): the function draws from a random source recompute does not "
                "replay (a generator of its own: draw from tp::rng_tracker() or the default generator instead) or "
                "reads state that changed since forward (a buffer, a captured tensor)");
  }
}

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

// Leaves that require grad reached from `roots` in the rerun's graph and are
// neither `known` nor reached through the graph of an earlier forward (a
// tensor computed outside fn and captured: an error).
std::vector<at::Tensor> other_leaves(const State& s, const variable_list& roots, const variable_list& known,
                                     uint64_t first_sequence_nr) {
  using torch::autograd::Node;
  const uint64_t thread = at::RecordFunction::currentThreadId();
  std::unordered_set<const Node*> seen;
  std::vector<Node*> stack;
  std::vector<at::Tensor> leaves;
  for (const auto& r : roots) {
    if (r.grad_fn()) stack.push_back(r.grad_fn().get());
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const at::Tensor& leaf = acc->variable;
      const bool is_known =
          std::any_of(known.begin(), known.end(), [&](const at::Tensor& k) { return same_tensor(k, leaf); });
      if (!is_known) leaves.push_back(leaf);
      continue;
    }
    // Nodes of the rerun were made on this thread, numbered from
    // first_sequence_nr on; commgrad's helper nodes (ops' WaitForGradient)
    // take number 0 on purpose, so that the engine runs them last.
    const uint64_t sequence_nr = node->sequence_nr();
    const bool helper = sequence_nr == 0 && node->name().rfind("commgrad::", 0) == 0;
    const bool earlier = node->thread_id() != thread || (!helper && sequence_nr < first_sequence_nr);
    TORCH_CHECK(!earlier, prefix(s.name), "the recomputed graph reaches '", node->name(),
                "', which was recorded before the rerun: the function uses a tensor that requires grad, was computed "
                "outside it and is not one of its inputs. Pass it as an input");
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  return leaves;
}

class RecomputeBackward : public torch::autograd::Node {
 public:
  explicit RecomputeBackward(std::shared_ptr<State> state) : name_(state->name), state_(std::move(state)) {}
  std::string name() const override { return "commgrad::tp::RecomputeBackward"; }
  void release_variables() override { state_.reset(); }
  std::vector<at::Tensor> saved_inputs() const { return state_ ? state_->inputs : std::vector<at::Tensor>{}; }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(state_, prefix(name_),
                "backward through the recomputed function a second time, but its inputs were "
                "already freed; use retain_graph=true on the first backward");
    State& s = *state_;
    check_versions(s, "between forward and backward");
    variable_list detached(s.inputs.size());
    for (size_t i = 0; i < s.inputs.size(); ++i) {
      if (!s.inputs[i].defined()) continue;
      detached[i] = s.inputs[i].detach();
      if (s.needs_grad[i]) detached[i].requires_grad_(true);
    }
    const uint64_t first_sequence_nr = at::sequence_number::peek();
    const std::vector<at::Tensor> rerun = run(s, detached);
    check_outputs(s, rerun);
    return back_propagate(s, rerun, detached, grads, first_sequence_nr);
  }

 private:
  static std::vector<at::Tensor> run(State& s, const variable_list& detached) {
    at::AutoGradMode enable_grad(true);
    DeferralReplay deferral(s.deferral);
    if (!s.preserve_rng) return s.fn(detached);
    RngReplay replay(s.rng, s.devices);
    return s.fn(detached);
  }

  variable_list back_propagate(State& s, const std::vector<at::Tensor>& rerun, const variable_list& detached,
                               const variable_list& grads, uint64_t first_sequence_nr) {
    variable_list roots, root_grads;
    for (size_t i = 0; i < rerun.size(); ++i) {
      const auto& node_input = s.outputs[i].node_input;
      if (!node_input || !grads[*node_input].defined() || !rerun[i].requires_grad()) continue;
      roots.push_back(rerun[i]);
      root_grads.push_back(grads[*node_input]);
    }
    variable_list result(s.inputs.size() + s.parameters.size());
    if (roots.empty()) return result;
    // What to differentiate with respect to, and where each gradient goes.
    constexpr size_t kOtherLeaf = static_cast<size_t>(-1);
    variable_list targets;
    std::vector<size_t> where;  // index in `result`, or kOtherLeaf
    auto add_target = [&](const at::Tensor& t, size_t index) {
      targets.push_back(t);
      where.push_back(index);
    };
    for (size_t i = 0; i < detached.size(); ++i) {
      if (detached[i].defined() && detached[i].requires_grad()) add_target(detached[i], i);
    }
    for (size_t i = 0; i < s.parameters.size(); ++i) {
      if (s.parameters[i].requires_grad()) add_target(s.parameters[i], s.inputs.size() + i);
    }
    for (const auto& leaf : other_leaves(s, roots, targets, first_sequence_nr)) add_target(leaf, kOtherLeaf);
    if (targets.empty()) return result;
    const variable_list g = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
    variable_list other_leaves_with_grad, other_grads;
    for (size_t k = 0; k < targets.size(); ++k) {
      if (where[k] != kOtherLeaf) {
        result[where[k]] = g[k];
      } else if (g[k].defined()) {
        other_leaves_with_grad.push_back(targets[k]);
        other_grads.push_back(g[k]);
      }
    }
    if (!other_leaves_with_grad.empty()) torch::autograd::backward(other_leaves_with_grad, other_grads);
    return result;
  }

  std::string name_;
  std::shared_ptr<State> state_;
};

bool differentiable(const at::Tensor& t) { return t.defined() && (t.is_floating_point() || t.is_complex()); }

std::vector<at::Tensor> declared_parameters(const std::vector<at::Tensor>& parameters,
                                            const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> kept;
  auto seen_in = [](const std::vector<at::Tensor>& list, const at::Tensor& p) {
    return std::any_of(list.begin(), list.end(), [&](const at::Tensor& q) { return q.defined() && same_tensor(p, q); });
  };
  for (const auto& p : parameters) {
    if (p.defined() && !seen_in(inputs, p) && !seen_in(kept, p)) kept.push_back(p);
  }
  return kept;
}

}  // namespace

const char* recompute_granularity_name(RecomputeGranularity granularity) {
  switch (granularity) {
    case RecomputeGranularity::kNone:
      return "none";
    case RecomputeGranularity::kSelective:
      return "selective";
    case RecomputeGranularity::kFull:
      return "full";
  }
  return "?";
}

std::vector<at::Tensor> recompute(const RecomputeFunction& fn, const std::vector<at::Tensor>& inputs,
                                  const RecomputeOptions& options) {
  TORCH_CHECK(static_cast<bool>(fn), prefix(options.name()), "the function is empty");
  if (!at::GradMode::is_enabled()) return fn(inputs);

  auto state = std::make_shared<State>();
  State& s = *state;
  s.fn = fn;
  s.name = options.name();
  s.preserve_rng = options.preserve_rng_state();
  s.devices = cuda_devices(inputs);
  for (const auto& x : inputs) {
    s.inputs.push_back(x.defined() ? x.detach() : at::Tensor());
    s.versions.push_back(x.defined() ? static_cast<int64_t>(x._version()) : 0);
    s.needs_grad.push_back(x.defined() && x.requires_grad());
  }
  s.parameters = declared_parameters(options.parameters(), inputs);
  if (s.preserve_rng) s.rng = capture_rng(rng_tracker(), s.devices);
  s.deferral = detail::deferring_weight_gradients();

  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  check_versions(s, "by the function itself");

  auto node = commgrad::detail::make_node<RecomputeBackward>(state);
  torch::autograd::edge_list edges;
  auto add_edges = [&](const std::vector<at::Tensor>& tensors) {
    for (const auto& t : tensors) {
      edges.push_back(t.defined() ? torch::autograd::impl::gradient_edge(t) : torch::autograd::Edge());
    }
  };
  add_edges(inputs);        // result[i] of RecomputeBackward::apply
  add_edges(s.parameters);  // result[inputs.size() + i]
  node->set_next_edges(std::move(edges));
  for (auto& o : outputs) {
    OutputMeta m;
    m.defined = o.defined();
    if (o.defined()) m.sizes = o.sizes().vec(), m.dtype = o.scalar_type(), m.device = o.device();
    if (options.check_rerun() && options.preserve_rng_state() && o.defined() && o.is_floating_point())
      m.checksum = checksum(o);
    if (differentiable(o)) {
      // A tensor of its own (same storage): an output may be an input, a view
      // or another output, and is about to get a grad_fn of its own.
      o = o.detach();
      torch::autograd::create_gradient_edge(o, node);
      m.node_input = s.attached++;
    }
    s.outputs.push_back(std::move(m));
  }
  return outputs;
}

std::vector<at::Tensor> recompute_saved_inputs(const at::Tensor& output) {
  if (!output.defined() || !output.grad_fn()) return {};
  const auto* node = dynamic_cast<const RecomputeBackward*>(output.grad_fn().get());
  return node != nullptr ? node->saved_inputs() : std::vector<at::Tensor>{};
}

at::Tensor recompute(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                     const RecomputeOptions& options) {
  TORCH_CHECK(static_cast<bool>(fn), prefix(options.name()), "the function is empty");
  auto wrapped = [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; };
  return recompute(RecomputeFunction(wrapped), std::vector<at::Tensor>{input}, options)[0];
}

}  // namespace commgrad::tp
