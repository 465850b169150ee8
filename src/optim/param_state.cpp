// The state of torch::optim optimizers by name. Each optimizer keeps a
// `XParamState` with TORCH_ARG members; this file is the one table that maps
// member names to them, for the five optimizers of LibTorch that keep
// per-element state.

#include "commgrad/optim/param_state.h"

#include <torch/optim.h>

#include <functional>
#include <memory>
#include <sstream>
#include <type_traits>

namespace commgrad::optim {
namespace {

using torch::optim::Optimizer;
using torch::optim::OptimizerParamState;

// The key torch::optim keeps a parameter's state under: the address of its
// TensorImpl, as a string up to 1.13 and as the pointer in 2.x (detected
// from the map's key type, so no version test).
template <class O = Optimizer>
auto state_key(O& optimizer, const at::Tensor& param) {
  using Key = typename std::decay_t<decltype(optimizer.state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream out;
    out << static_cast<const void*>(param.unsafeGetTensorImpl());
    return out.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

// One member of a param state: its name, a getter and a setter.
template <class State>
struct Member {
  const char* name;
  std::function<const at::Tensor&(State&)> get;
  std::function<void(State&, const at::Tensor&)> set;
};

#define COMMGRAD_MEMBER(State, m)                                                                            \
  Member<State> {                                                                                            \
#m, [](State & s) -> const at::Tensor& { return s.m(); }, [](State & s, const at::Tensor& t) { s.m(t); } \
  }

template <class State>
std::vector<Member<State>> members();
template <>
std::vector<Member<torch::optim::AdamParamState>> members() {
  using S = torch::optim::AdamParamState;
  return {COMMGRAD_MEMBER(S, exp_avg), COMMGRAD_MEMBER(S, exp_avg_sq), COMMGRAD_MEMBER(S, max_exp_avg_sq)};
}
template <>
std::vector<Member<torch::optim::AdamWParamState>> members() {
  using S = torch::optim::AdamWParamState;
  return {COMMGRAD_MEMBER(S, exp_avg), COMMGRAD_MEMBER(S, exp_avg_sq), COMMGRAD_MEMBER(S, max_exp_avg_sq)};
}
template <>
std::vector<Member<torch::optim::SGDParamState>> members() {
  using S = torch::optim::SGDParamState;
  return {COMMGRAD_MEMBER(S, momentum_buffer)};
}
template <>
std::vector<Member<torch::optim::AdagradParamState>> members() {
  using S = torch::optim::AdagradParamState;
  return {COMMGRAD_MEMBER(S, sum)};
}
template <>
std::vector<Member<torch::optim::RMSpropParamState>> members() {
  using S = torch::optim::RMSpropParamState;
  return {COMMGRAD_MEMBER(S, square_avg), COMMGRAD_MEMBER(S, momentum_buffer), COMMGRAD_MEMBER(S, grad_avg)};
}
#undef COMMGRAD_MEMBER

template <class State>
constexpr bool kHasStep = !std::is_same_v<State, torch::optim::SGDParamState>;

template <class State>
ParamState read(State& s) {
  ParamState out;
  for (const auto& m : members<State>()) {
    if (m.get(s).defined()) out.tensors.emplace_back(m.name, m.get(s));
  }
  if constexpr (kHasStep<State>) out.step = s.step();
  return out;
}

template <class State>
void write(Optimizer& optimizer, const at::Tensor& param, const ParamState& in, const char* type) {
  auto& slot = optimizer.state()[state_key(optimizer, param)];
  if (!slot) slot = std::make_unique<State>();
  auto& s = static_cast<State&>(*slot);
  const auto all = members<State>();
  for (const auto& [name, tensor] : in.tensors) {
    auto it = std::find_if(all.begin(), all.end(), [&](const auto& m) { return name == m.name; });
    TORCH_CHECK(it != all.end(), "[commgrad] set_param_state: ", type, " keeps no state tensor '", name, "'");
    TORCH_CHECK(tensor.sizes() == param.sizes(), "[commgrad] set_param_state: ", type, " state '", name, "' has shape ",
                tensor.sizes(), ", but the parameter has shape ", param.sizes());
    it->set(s, tensor.detach().to(param.options().requires_grad(false)).clone().view(param.sizes()));
  }
  if constexpr (kHasStep<State>) {
    if (in.step) s.step(*in.step);
  }
}

// Calls f.template operator()<State>(type name) for the optimizer's type.
template <class F>
auto dispatch(Optimizer& optimizer, F&& f) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    return f(static_cast<torch::optim::AdamWParamState*>(nullptr), "AdamW");
  if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    return f(static_cast<torch::optim::AdamParamState*>(nullptr), "Adam");
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return f(static_cast<torch::optim::SGDParamState*>(nullptr), "SGD");
  if (dynamic_cast<torch::optim::Adagrad*>(&optimizer))
    return f(static_cast<torch::optim::AdagradParamState*>(nullptr), "Adagrad");
  if (dynamic_cast<torch::optim::RMSprop*>(&optimizer))
    return f(static_cast<torch::optim::RMSpropParamState*>(nullptr), "RMSprop");
  TORCH_CHECK(false, "[commgrad] optimizer state: ", typeid(optimizer).name(),
              " is not supported (Adam, AdamW, SGD, Adagrad and RMSprop are; LBFGS keeps no per-element state)");
}

}  // namespace

std::optional<ParamState> get_param_state(Optimizer& optimizer, const at::Tensor& param) {
  return dispatch(optimizer, [&](auto* tag, const char*) -> std::optional<ParamState> {
    using State = std::remove_pointer_t<decltype(tag)>;
    auto it = optimizer.state().find(state_key(optimizer, param));
    if (it == optimizer.state().end() || !it->second) return std::nullopt;
    return read(static_cast<State&>(*it->second));
  });
}

void set_param_state(Optimizer& optimizer, const at::Tensor& param, const ParamState& state) {
  dispatch(optimizer, [&](auto* tag, const char* type) {
    using State = std::remove_pointer_t<decltype(tag)>;
    write<State>(optimizer, param, state, type);
  });
}

std::vector<std::string> param_state_names(Optimizer& optimizer) {
  return dispatch(optimizer, [&](auto* tag, const char*) {
    using State = std::remove_pointer_t<decltype(tag)>;
    std::vector<std::string> names;
    for (const auto& m : members<State>()) names.emplace_back(m.name);
    return names;
  });
}

}  // namespace commgrad::optim
