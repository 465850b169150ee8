// ZeroOptimizer's state for checkpoints: this rank's ranges of it
// (state_shards, load_state_shards) and the whole of it gathered over the
// group (full_state_dict, load_full_state_dict), with float32 master weights
// as state "master". The keys are an unsharded optimizer's
// (unsharded_state_dict), so checkpoints move between ZeRO, DDP and FSDP.

#include "detail/zero_impl.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/names.h"

#include <algorithm>

namespace commgrad::optim {

using detail::kMaster;
using detail::kZeroOp;

std::optional<ParamState> ZeroOptimizer::Impl::state_of(const Shard& s) const {
  if (!s.master.defined()) return std::nullopt;
  auto state = get_param_state(*optimizer, s.master);
  if (state && s.separate_master) state->tensors.emplace_back(kMaster, s.master);
  return state;
}

std::vector<ZeroOptimizer::StateShard> ZeroOptimizer::state_shards() const {
  std::vector<StateShard> out;
  for (const auto& s : impl_->shards) {
    const auto state = impl_->state_of(s);
    if (!state) continue;
    for (const auto& seg : s.info.segments) {
      for (const auto& [name, tensor] : state->tensors) {
        out.push_back({seg.name, name, seg.param_begin, tensor.narrow(0, seg.shard_offset, seg.length)});
      }
    }
  }
  return out;
}

std::vector<std::string> ZeroOptimizer::state_names() {
  auto names = param_state_names(*impl_->optimizer);
  const bool masters = std::any_of(impl_->shards.begin(), impl_->shards.end(),
                                   [](const Impl::Shard& s) { return s.state_dtype != s.params.scalar_type(); });
  if (masters) names.push_back(kMaster);
  return names;
}

int64_t ZeroOptimizer::step_count() const {
  for (const auto& s : impl_->shards) {
    if (auto state = impl_->state_of(s)) return state->step.value_or(0);
  }
  return 0;
}

ZeroOptimizer::Impl::Shard* ZeroOptimizer::Impl::shard_with(const std::string& param, int64_t param_begin,
                                                            size_t* segment) {
  for (auto& s : shards) {
    for (size_t i = 0; i < s.info.segments.size(); ++i) {
      if (s.info.segments[i].name == param && s.info.segments[i].param_begin == param_begin) {
        *segment = i;
        return &s;
      }
    }
  }
  return nullptr;
}

void ZeroOptimizer::load_state_shards(const std::vector<StateShard>& shards, int64_t step) {
  auto& m = *impl_;
  at::NoGradGuard no_grad;
  std::map<Impl::Shard*, std::map<std::string, at::Tensor>> states;
  for (const auto& in : shards) {
    size_t i = 0;
    auto* s = m.shard_with(in.param, in.param_begin, &i);
    COMMGRAD_CHECK(s, kZeroOp, m.group, "load_state_shards: no range of this rank starts at element ", in.param_begin,
                   " of parameter '", in.param, "'");
    const auto& seg = s->info.segments[i];
    COMMGRAD_CHECK(in.tensor.numel() == seg.length, kZeroOp, m.group, "load_state_shards: state '", in.state,
                   "' of parameter '", in.param, "' from element ", in.param_begin, " has ", in.tensor.numel(),
                   " elements, but this rank's range of it has ", seg.length);
    if (in.state == kMaster) {
      COMMGRAD_CHECK(s->separate_master, kZeroOp, m.group, "load_state_shards: master weights of parameter '", in.param,
                     "' given, but this optimizer keeps none (float32_master with float16/bfloat16 parameters)");
      s->master.narrow(0, seg.shard_offset, seg.length).copy_(in.tensor.reshape({-1}));
      s->params.narrow(0, s->info.begin + seg.shard_offset, seg.length).copy_(in.tensor.reshape({-1}));
      continue;
    }
    auto& t = states[s][in.state];
    if (!t.defined()) t = at::zeros({s->info.end - s->info.begin}, s->master.options());
    t.narrow(0, seg.shard_offset, seg.length).copy_(in.tensor.reshape({-1}));
  }
  for (auto& [s, tensors] : states) {
    ParamState state;
    for (auto& [name, t] : tensors) state.tensors.emplace_back(name, t);
    state.step = step;
    set_param_state(*m.optimizer, s->master, state);
  }
}

torch::OrderedDict<std::string, at::Tensor> ZeroOptimizer::full_state_dict() {
  auto& m = *impl_;
  at::NoGradGuard no_grad;
  const auto names = state_names();
  torch::OrderedDict<std::string, at::Tensor> out;
  // Which state tensors exist anywhere (a rank with empty ranges has none).
  auto present = at::zeros({static_cast<int64_t>(names.size()) + 1}, at::kLong);
  for (const auto& s : m.shards) {
    if (auto state = m.state_of(s)) {
      for (size_t k = 0; k < names.size(); ++k) {
        for (const auto& entry : state->tensors) {
          if (entry.first == names[k]) present[k] = 1;
        }
      }
      present[names.size()] = std::max<int64_t>(present[names.size()].item<int64_t>(), state->step.value_or(0));
    }
  }
  ops::raw::all_reduce_(present, ops::AllReduceOptions().op(ReduceOp::kMax), m.group).wait();
  for (size_t k = 0; k < names.size(); ++k) {
    if (present[k].item<int64_t>() == 0) continue;
    for (auto& s : m.shards) {
      // Every rank's ranges of a bucket share one dtype (the master's).
      auto mine = at::zeros({s.chunk}, s.params.options().dtype(s.state_dtype));
      if (auto state = m.state_of(s)) {
        for (const auto& entry : state->tensors) {
          if (entry.first == names[k]) mine.narrow(0, 0, entry.second.numel()).copy_(entry.second);
        }
      }
      const auto full = ops::raw::all_gather(mine, {}, m.group).wait();
      for (size_t i = 0; i < s.names.size(); ++i) {
        const auto& p = m.params.at(s.names[i]);
        out.insert(s.names[i] + "/" + names[k], full.narrow(0, s.offsets[i], p.numel()).view(p.sizes()).clone());
      }
    }
  }
  out.insert("step", at::scalar_tensor(present[names.size()].item<int64_t>(), at::kLong));
  return out;
}

void ZeroOptimizer::load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& full) {
  auto& m = *impl_;
  const auto names = state_names();
  const auto* step = full.find("step");
  COMMGRAD_CHECK(step, kZeroOp, m.group, "load_full_state_dict: no 'step' entry");
  std::vector<StateShard> mine;
  for (const auto& s : m.shards) {
    for (const auto& seg : s.info.segments) {
      for (const auto& name : names) {
        const auto* t = full.find(seg.name + "/" + name);
        if (!t || (name == kMaster && !s.separate_master)) continue;
        const auto& p = m.params.at(seg.name);
        COMMGRAD_CHECK(t->numel() == p.numel(), kZeroOp, m.group, "load_full_state_dict: '", seg.name, "/", name,
                       "' is ", tensor_name(*t), ", but the parameter is ", tensor_name(p));
        mine.push_back({seg.name, name, seg.param_begin, t->reshape({-1}).narrow(0, seg.param_begin, seg.length)});
      }
    }
  }
  load_state_shards(mine, step->item<int64_t>());
}

torch::OrderedDict<std::string, at::Tensor> unsharded_state_dict(const torch::nn::Module& module,
                                                                 torch::optim::Optimizer& optimizer) {
  torch::OrderedDict<std::string, at::Tensor> out;
  int64_t step = 0;
  for (const auto& item : module.named_parameters()) {
    const auto state = get_param_state(optimizer, item.value());
    if (!state) continue;
    for (const auto& [name, t] : state->tensors) out.insert(item.key() + "/" + name, t.clone());
    step = std::max(step, state->step.value_or(0));
  }
  out.insert("step", at::scalar_tensor(step, at::kLong));
  return out;
}

}  // namespace commgrad::optim
