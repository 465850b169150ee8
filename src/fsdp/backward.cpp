// A unit's backward: gather again, reduce-scatter the gradients, hand this
// rank's part to the pieces.
//
// Before. The unit's outputs pass through a PreBackward node; when backward
// reaches it, the unit is gathered again (unless it still is) and the unit
// that ran before it in forward is prefetched.
//
// Deferred weight gradients (zero-bubble schedules: tp/weight_gradients.h)
// accumulate in W, after the unit's backward has resharded it; a pre hook on
// the accumulator gives the compute tensor its shape for that (over the
// freed buffer, which accumulation does not read) and the post hook takes
// it back. The pipeline runs every B and W but the stage's last W under
// no_sync, so the gradients accumulate unsharded and the reduce-scatters
// start at the end of that last W, once every deferred gradient is in.
//
// After. Each parameter's gradient accumulator has a post hook; when every
// parameter of the unit that requires grad has its gradient, the unit's
// backward is over: the gradients are packed (in the reduction dtype,
// divided for the average) into one flat buffer, the compute tensors'
// gradients dropped, the gathered buffer freed, and the reduce-scatter
// started. Reduce-scatters start in the reverse of the forward order on
// every rank: a unit ready before the ones ahead of it waits for them.
// (A unit with frozen parameters keeps its buffer to the end of backward:
// nothing tells when the last use of a frozen parameter has run.)
//
// End. The tree's end-of-backward callback (queued with the autograd engine
// by the first hook of the backward) launches what is left (units whose
// gradients did not all arrive: the missing ones count as zero), waits for
// every reduce-scatter in launch order, adds this rank's part to the
// pieces' `.grad()`, frees every gathered buffer and resets. A backward that
// fails half way drops the callback; its destructor drains instead.
//
// Tripwires. An optimizer built over the module's parameters before
// fully_shard holds the tensors the module's code reads, whose gradients
// backward drops: it would skip them, silently. So after a synchronised
// backward each of them holds one element, 0, with a gradient of 1, which
// such an optimizer steps (torch::optim updates `.data()`, whose version
// counter is not the parameter's, so the value is what tells); the unit's
// next forward finds the element changed and says what happened.

#include "detail/unit.h"

#include "commgrad/dist/check.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

namespace commgrad::fsdp::detail {
namespace {

class PreBackward : public torch::autograd::Node {
 public:
  explicit PreBackward(std::weak_ptr<Unit> unit) : unit_(std::move(unit)) {}
  std::string name() const override { return "commgrad::fsdp::PreBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (auto unit = unit_.lock()) unit->before_backward();
    return std::move(grads);
  }

 private:
  std::weak_ptr<Unit> unit_;
};

// Calls Unit::before_accumulate before the parameter's AccumulateGrad.
class BeforeAccumulate : public torch::autograd::FunctionPreHook {
 public:
  BeforeAccumulate(std::weak_ptr<Unit> unit, size_t param) : unit_(std::move(unit)), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto unit = unit_.lock()) unit->before_accumulate(param_);
    return grads;
  }

 private:
  std::weak_ptr<Unit> unit_;
  size_t param_;
};

// Runs the tree's end of backward from the engine's final callbacks, or
// drains it when the backward failed and the engine dropped the callback.
struct EndOfBackward {
  explicit EndOfBackward(std::weak_ptr<Tree> t) : tree(std::move(t)) {}
  ~EndOfBackward() {
    if (ran) return;
    try {
      if (auto t = tree.lock()) finish(*t, /*failed=*/true);
    } catch (...) {
    }
  }
  void run() {
    ran = true;
    if (auto t = tree.lock()) finish(*t, /*failed=*/false);
  }

  static void finish(Tree& t, bool failed) {
    t.callback_queued = false;
    if (t.sync && !failed) {
      for (auto it = t.order.rbegin(); it != t.order.rend(); ++it) (*it)->launch_reduction();
    }
    std::exception_ptr error;
    for (Unit* u : t.launched) {
      try {
        u->finish_reduction();
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    t.launched.clear();
    for (Unit* u : t.units) u->end_backward();
    if (t.sync && !failed && !error) {
      for (Unit* u : t.units) u->arm_tripwires();
    }
    if (t.sync) {
      t.last_order = std::move(t.order);
      t.order.clear();
      t.last = t.current;
      t.current = StepStats{};
    }
    if (error) std::rethrow_exception(error);
  }

  std::weak_ptr<Tree> tree;
  bool ran = false;
};

}  // namespace

void route_through_pre_backward(Unit& unit, std::vector<at::Tensor>& outputs) {
  std::vector<size_t> routed;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad()) routed.push_back(i);
  }
  if (routed.empty()) return;
  auto node = commgrad::detail::make_node<PreBackward>(unit.weak_from_this());
  for (size_t i : routed) {
    node->add_next_edge(torch::autograd::impl::gradient_edge(outputs[i]));
    at::Tensor out = outputs[i].detach();
    torch::autograd::set_history(out, node);
    outputs[i] = out;
  }
}

void ensure_end_of_backward(const std::shared_ptr<Tree>& tree) {
  if (tree->callback_queued) return;
  tree->callback_queued = true;
  auto end = std::make_shared<EndOfBackward>(tree);
  torch::autograd::Engine::get_default_engine().queue_callback([end] { end->run(); });
}

void Unit::install_hooks() {
  std::weak_ptr<Unit> weak = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!p.requires_grad) continue;
    // Held here, so the node (and its hook) outlives each step's graph.
    p.accumulator = torch::autograd::impl::grad_accumulator(p.compute);
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto self = weak.lock()) self->on_gradient(i);
          return outputs;
        }));
    p.accumulator->add_pre_hook(std::make_unique<BeforeAccumulate>(weak, i));
  }
}

void Unit::before_accumulate(size_t param) {
  if (!unsharded_) params_[param].compute.set_data(params_[param].view);
}

void Unit::before_backward() {
  ensure_end_of_backward(tree_);
  unshard();
  // Prefetch the unit that ran before this one in forward.
  auto& order = tree_->order;
  auto it = std::find(order.begin(), order.end(), this);
  if (it != order.end() && it != order.begin()) (*(it - 1))->start_gather(/*prefetch=*/true);
}

void Unit::on_gradient(size_t param) {
  auto& p = params_[param];
  if (!unsharded_) p.compute.set_data(empty_);  // after before_accumulate
  ensure_end_of_backward(tree_);
  COMMGRAD_CHECK(in_order_, "fully_shard", group_, "parameter '", p.name,
                 "' got a gradient, but its unit did not run through commgrad::fsdp::call in this step (a sharded "
                 "module's code must run inside call() or call_function() of its unit)");
  if (p.ready) return;
  p.ready = true;
  if (++ready_ == trainable_) post_backward();
}

void Unit::post_backward() {
  if (!tree_->sync) {
    if (!has_frozen_) reshard();
    return;
  }
  payload_ = pack_gradients();
  if (!has_frozen_) reshard();
  // Launch in the reverse of the forward order: this unit and any ready after it.
  auto& order = tree_->order;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Unit* u = *it;
    if (u->launched_ || u->params_.empty()) continue;
    if (!u->packed_) break;
    u->launch_reduction();
  }
}

at::Tensor Unit::pack_gradients() {
  at::NoGradGuard no_grad;
  auto payload = at::zeros({padded_}, shard_.options().dtype(reduce_dtype_));
  for (auto& p : params_) {
    if (!p.requires_grad) continue;
    at::Tensor& g = p.compute.mutable_grad();
    if (g.defined()) payload.narrow(0, p.offset, p.numel).copy_(g.reshape({-1}));
    g.reset();
  }
  sum_partial_gradients(payload);
  payload.div_(pre_divide_);
  packed_ = true;
  return payload;
}

// Parameters used inside a sequence-parallel region (LayerNorm weights,
// row-parallel biases) hold each TP rank's part of the sequence: their
// gradients are summed over the TP group before the data-parallel
// reduce-scatter (the unit's layout differs per TP rank, so not after it).
void Unit::sum_partial_gradients(at::Tensor& payload) const {
  std::vector<std::pair<Group, std::vector<const Param*>>> by_group;
  for (const auto& p : params_) {
    if (!p.requires_grad || !p.partial_group.defined()) continue;
    auto it = std::find_if(by_group.begin(), by_group.end(), [&](const auto& e) { return e.first == p.partial_group; });
    if (it == by_group.end()) it = by_group.insert(by_group.end(), {p.partial_group, {}});
    it->second.push_back(&p);
  }
  for (auto& [group, params] : by_group) {
    std::vector<at::Tensor> parts;
    for (const Param* p : params) parts.push_back(payload.narrow(0, p->offset, p->numel));
    const at::Tensor summed = ops::raw::all_reduce(at::cat(parts), {}, group).wait();
    int64_t at = 0;
    for (const Param* p : params) {
      payload.narrow(0, p->offset, p->numel).copy_(summed.narrow(0, at, p->numel));
      at += p->numel;
    }
  }
}

void Unit::launch_reduction() {
  if (launched_ || !in_order_ || params_.empty()) return;
  if (!packed_) payload_ = pack_gradients();
  reduction_ = ops::raw::reduce_scatter(payload_, ops::ReduceScatterOptions().dim(0).op(ReduceOp::kSum), group_);
  payload_ = at::Tensor();
  launched_ = true;
  tree_->launched.push_back(this);
  ++tree_->current.reduce_scatters;
}

void Unit::finish_reduction() {
  at::Tensor reduced = reduction_.wait();
  reduction_ = ops::raw::Pending();
  at::NoGradGuard no_grad;
  if (options_.replicate_group().defined() && options_.replicate_group().size() > 1) {
    reduced =
        ops::raw::all_reduce(reduced, ops::AllReduceOptions().op(ReduceOp::kSum), options_.replicate_group()).wait();
  }
  if (post_divide_ != 1) reduced.div_(post_divide_);
  at::Tensor master = reduced.to(dtype_);
  for (auto& p : params_) {
    if (!p.requires_grad) continue;
    at::Tensor part = master.narrow(0, p.shard_offset, p.length);
    at::Tensor& g = p.piece.mutable_grad();
    if (g.defined()) {
      g.add_(part);
    } else {
      g = alias(master, p.shard_offset, {p.length});
    }
  }
}

void Unit::arm_tripwires() {
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    if (!p.requires_grad || p.compute.grad().defined() || unsharded_) continue;
    p.tripwire = at::zeros({1}, p.compute.options());
    p.compute.set_data(p.tripwire);
    p.compute.mutable_grad() = at::ones({1}, p.compute.options());
  }
}

void Unit::check_tripwires() {
  for (auto& p : params_) {
    if (!p.tripwire.defined()) continue;
    const bool stepped = !p.tripwire.eq(0).all().item<bool>();
    p.tripwire = at::Tensor();
    p.compute.mutable_grad().reset();
    p.compute.set_data(unsharded_ ? p.view : empty_);
    COMMGRAD_CHECK(!stepped, "fully_shard", group_, "an optimizer stepped parameter '", p.name, "' of the unit of ",
                   module_.expired() ? std::string("?") : module_.lock()->name(),
                   " as it was before fully_shard (the tensor fully_shard replaced by this rank's piece), so the "
                   "model does not train: build the optimizer over module->parameters() after fully_shard");
  }
}

void Unit::end_backward() {
  reshard();
  drop_gather();
  if (tree_->sync) in_order_ = false;
  for (auto& p : params_) p.ready = false;
  ready_ = 0;
  packed_ = false;
  launched_ = false;
  payload_ = at::Tensor();
}

}  // namespace commgrad::fsdp::detail
