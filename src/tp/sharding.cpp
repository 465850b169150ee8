// Shard specs and full state dicts.
//
// A partitioned tensor of full size S along `dim`, split n ways with stride
// k, is cut into k n equal blocks b_0 .. b_{kn-1}; rank r holds
// [b_r, b_{r+n}, ..., b_{r+(k-1)n}] concatenated (Megatron's
// _initialize_affine_weight_cpu). shard_tensor() takes those blocks;
// unshard_tensors() puts every rank's blocks back in order. With k = 1 this
// is the plain r-th slice and the concatenation of the shards.
//
// Gathering uses ops::raw::all_gather (not differentiable: state dicts and
// gradients are data, not part of a graph).

#include "commgrad/tp/sharding.h"

#include "detail/common.h"

#include "commgrad/ops/raw.h"
#include "commgrad/tp/mappings.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <functional>
#include <iterator>

namespace commgrad::tp {

std::string ShardSpec::describe() const {
  if (!is_partitioned()) return partial_grad ? "replicated, partial grad" : "replicated";
  if (stride > 1) return c10::str("split(", dim, ", stride ", stride, ")");
  return c10::str("split(", dim, ")");
}

std::ostream& operator<<(std::ostream& out, const ShardSpec& spec) { return out << spec.describe(); }

namespace {

// Throws "[commgrad] <op> rank r/n group 'g' (<transport>): <message>" for a
// tensor of `group`, or "[commgrad] <op>: <message>" where there is no group
// (shard_tensor and unshard_tensors take ranks and shards, not a group; a
// parameter of a module that is not a ShardedModule has none).
void fail_unless(bool cond, const char* op, const Group& group, const std::function<std::string()>& message) {
  if (cond) return;
  if (group.defined()) {
    COMMGRAD_CHECK(false, op, group, message());
  }
  TORCH_CHECK(false, "[commgrad] ", op, ": ", message());
}

int64_t wrap_dim(const at::Tensor& t, const ShardSpec& spec, const char* op, const Group& group = Group()) {
  const int64_t nd = t.dim();
  fail_unless(nd > 0 && spec.dim >= -nd && spec.dim < nd, op, group,
              [&] { return c10::str("partition dim ", spec.dim, " is out of range for ", detail::describe(t)); });
  return spec.dim < 0 ? spec.dim + nd : spec.dim;
}

}  // namespace

at::Tensor shard_tensor(const at::Tensor& full, const ShardSpec& spec, int rank, int size) {
  if (!spec.is_partitioned()) return full;
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "[commgrad] shard_tensor: rank ", rank, " of ", size);
  TORCH_CHECK(spec.stride >= 1, "[commgrad] shard_tensor: stride must be at least 1, got ", spec.stride);
  const int64_t dim = wrap_dim(full, spec, "shard_tensor");
  const int64_t blocks = spec.stride * size;
  TORCH_CHECK(full.size(dim) % blocks == 0, "[commgrad] shard_tensor: dim ", dim, " of ", detail::describe(full),
              " is not divisible by the tensor-parallel size ", size,
              spec.stride > 1 ? c10::str(" x stride ", spec.stride) : std::string());
  const auto parts = full.chunk(blocks, dim);
  if (spec.stride == 1) return parts[rank].contiguous();
  std::vector<at::Tensor> mine;
  for (int64_t k = 0; k < spec.stride; ++k) mine.push_back(parts[rank + k * size]);
  return at::cat(mine, dim);
}

at::Tensor unshard_tensors(const std::vector<at::Tensor>& shards, const ShardSpec& spec) {
  TORCH_CHECK(!shards.empty(), "[commgrad] unshard_tensors: no shards");
  if (!spec.is_partitioned()) return shards[0];
  const int64_t dim = wrap_dim(shards[0], spec, "unshard_tensors");
  if (spec.stride == 1) return at::cat(shards, dim);
  const int64_t n = static_cast<int64_t>(shards.size());
  std::vector<std::vector<at::Tensor>> blocks;
  for (const auto& s : shards) {
    TORCH_CHECK(s.size(dim) % spec.stride == 0, "[commgrad] unshard_tensors: shard ", detail::describe(s),
                " is not divisible by stride ", spec.stride, " along dim ", dim);
    blocks.push_back(s.chunk(spec.stride, dim));
  }
  std::vector<at::Tensor> ordered;
  for (int64_t k = 0; k < spec.stride; ++k) {
    for (int64_t r = 0; r < n; ++r) ordered.push_back(blocks[r][k]);
  }
  return at::cat(ordered, dim);
}

at::Tensor gather_shards(const at::Tensor& local, const ShardSpec& spec, const Group& group) {
  if (!spec.is_partitioned()) return local;
  check_member("gather_shards", group);
  const int64_t dim = wrap_dim(local, spec, "gather_shards", group);
  const at::Tensor all = ops::raw::all_gather(local.detach(), ops::AllGatherOptions().dim(dim), group).wait();
  if (spec.stride == 1) return all;
  return unshard_tensors(all.chunk(group.size(), dim), spec);
}

// ~~~ ShardedModule ~~~

ShardSpec ShardedModule::shard_spec(const std::string& name) const {
  auto it = specs_.find(name);
  return it == specs_.end() ? ShardSpec::replicated() : it->second;
}

void ShardedModule::set_shard_spec(const std::string& name, const ShardSpec& spec, const Group& group) {
  specs_[name] = spec;
  shard_group_ = group;
}

torch::OrderedDict<std::string, ParameterShard> shard_specs(const torch::nn::Module& module) {
  torch::OrderedDict<std::string, ParameterShard> out;
  for (const auto& p : module.named_parameters()) out.insert(p.key(), ParameterShard{});
  // Outer modules first, so that a module's own specs override what an
  // ancestor said about the same parameter.
  for (const auto& m : module.named_modules()) {
    const auto* sharded = dynamic_cast<const ShardedModule*>(m.value().get());
    if (sharded == nullptr) continue;
    const std::string prefix = m.key().empty() ? "" : m.key() + ".";
    for (const auto& [name, spec] : sharded->shard_specs()) {
      if (auto* entry = out.find(prefix + name)) *entry = ParameterShard{spec, sharded->shard_group()};
    }
  }
  return out;
}

torch::OrderedDict<std::string, at::Tensor> gather_full_state_dict(const torch::nn::Module& module) {
  torch::OrderedDict<std::string, at::Tensor> full;
  const auto specs = shard_specs(module);
  for (const auto& p : module.named_parameters()) {
    const ParameterShard& s = specs[p.key()];
    full.insert(p.key(),
                s.spec.is_partitioned() ? gather_shards(p.value(), s.spec, s.group) : p.value().detach().clone());
  }
  for (const auto& b : module.named_buffers()) full.insert(b.key(), b.value().detach().clone());
  return full;
}

void load_full_state_dict(torch::nn::Module& module, const torch::OrderedDict<std::string, at::Tensor>& full) {
  const auto specs = shard_specs(module);
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters()) {
    const char* op = "load_full_state_dict";
    const at::Tensor* value = full.find(p.key());
    const ParameterShard& s = specs[p.key()];
    fail_unless(value != nullptr, op, s.group, [&] { return c10::str("the state dict has no entry '", p.key(), "'"); });
    const int n = s.spec.is_partitioned() ? s.group.size() : 1;
    auto expected = p.value().sizes().vec();
    if (s.spec.is_partitioned()) expected[wrap_dim(p.value(), s.spec, op, s.group)] *= n;
    fail_unless(value->sizes() == at::IntArrayRef(expected), op, s.group, [&] {
      return c10::str("'", p.key(), "' is ", detail::describe(*value), ", but the parameter (", s.spec.describe(),
                      " over ", n, " rank", n > 1 ? "s" : "", ") is ", c10::IntArrayRef(expected), " in full");
    });
    p.value().copy_(s.spec.is_partitioned() ? shard_tensor(*value, s.spec, s.group.rank(), n) : *value);
  }
  for (auto& b : module.named_buffers()) {
    const at::Tensor* value = full.find(b.key());
    TORCH_CHECK(value != nullptr, "[commgrad] load_full_state_dict: the state dict has no entry '", b.key(), "'");
    TORCH_CHECK(value->sizes() == b.value().sizes(), "[commgrad] load_full_state_dict: buffer '", b.key(), "' is ",
                detail::describe(*value), ", expected ", detail::describe(b.value()));
    b.value().copy_(*value);
  }
}

void allreduce_sequence_parallel_grads(torch::nn::Module& module) {
  const auto specs = shard_specs(module);
  // One all-reduce per group over the flattened partial gradients.
  std::vector<std::pair<Group, std::vector<at::Tensor>>> by_group;
  for (auto& p : module.named_parameters()) {
    const ParameterShard& s = specs[p.key()];
    if (!s.spec.partial_grad || !s.group.defined() || s.group.size() == 1) continue;
    at::Tensor& param = p.value();
    if (!param.grad().defined()) param.mutable_grad() = at::zeros_like(param);
    auto it = std::find_if(by_group.begin(), by_group.end(), [&](const auto& e) { return e.first == s.group; });
    if (it == by_group.end()) {
      by_group.push_back({s.group, {}});
      it = std::prev(by_group.end());
    }
    it->second.push_back(param.mutable_grad());
  }
  for (auto& [group, grads] : by_group) {
    std::vector<at::Tensor> flat;
    for (const auto& g : grads) flat.push_back(g.reshape({-1}));
    const at::Tensor summed = ops::raw::all_reduce(at::cat(flat), {}, group).wait();
    int64_t offset = 0;
    for (auto& g : grads) {
      g.copy_(summed.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  }
}

}  // namespace commgrad::tp
