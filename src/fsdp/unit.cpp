// A unit of fully_shard: its layout, its storage, and its forward.
//
// Layout. The unit's parameters, flattened in registration order, form one
// buffer of `numel` elements padded to `padded` (a multiple of the group
// size N); rank r keeps elements [r S, (r + 1) S), S = padded / N, as its
// shard, in the parameters' own dtype. Each parameter's intersection with
// the shard is its *piece*: a leaf tensor aliasing the shard, registered in
// the module under the parameter's name (possibly empty).
//
// Storage. The tensors the module's code reads (`compute`) are aliases of
// one gathered buffer `full_` in the compute dtype. Resharding frees the
// buffer's storage (its data pointer, not the StorageImpl) and points the
// compute tensors at an empty tensor; unsharding gives the same StorageImpl
// the all-gather's result (adopting its allocation when it can, so nothing
// is copied) and points the compute tensors back. Autograd keeps what it
// saved in forward (the compute tensors themselves, or views such as W^T)
// through the StorageImpl, so backward reads the values gathered again.

#include "detail/unit.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/dp/replicas.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <unordered_map>

namespace commgrad::fsdp::detail {
namespace {

constexpr int64_t kBroadcastCap = 32 << 20;

// A module's own parameters, writable (the dict named_parameters() copies).
struct ParameterRegistry : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& m) {
    return m.*(&ParameterRegistry::parameters_);
  }
};

bool under(const std::string& name, const std::vector<std::string>& prefixes) {
  return std::any_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return p.empty() || name == p || name.rfind(p + ".", 0) == 0; });
}

}  // namespace

at::Tensor alias(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  auto t = at::empty({0}, base.options().requires_grad(false));
  t.set_(base.storage(), base.storage_offset() + offset, sizes);
  return t;
}

Unit::Unit(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options,
           const std::vector<std::shared_ptr<Unit>>& inner)
    : module_(module), module_address_(module.get()), options_(std::move(options)) {
  group_ = options_.group().defined() ? options_.group() : default_data_parallel_group();
  options_.group(group_);
  check_member(kFullyShardOp, group_);
  if (options_.replicate_group().defined()) check_member(kFullyShardOp, options_.replicate_group());
  COMMGRAD_CHECK(options_.average_divisor() >= 0, kFullyShardOp, group_,
                 "average_divisor must be 0 (the ranks holding a copy) "
                 "or positive, got ",
                 options_.average_divisor());
  dp::check_policy(options_.mixed_precision(), kFullyShardOp);
  collect(module, inner);
  make_equal_everywhere();
  lay_out();
  register_pieces();
}

Unit::~Unit() {
  for (auto& p : params_) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

// The parameters of `module`'s tree that no inner unit holds, each once.
void Unit::collect(const std::shared_ptr<torch::nn::Module>& module, const std::vector<std::shared_ptr<Unit>>& inner) {
  std::vector<std::string> skipped;
  for (const auto& item : module->named_modules("", /*include_self=*/true)) {
    for (const auto& u : inner) {
      if (u->module_address() == item.value().get()) skipped.push_back(item.key());
    }
  }
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  for (const auto& item : module->named_modules("", /*include_self=*/true)) {
    if (!skipped.empty() && under(item.key(), skipped)) continue;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const std::string name = item.key().empty() ? p.key() : item.key() + "." + p.key();
      const at::Tensor& t = p.value();
      COMMGRAD_CHECK(t.defined() && t.layout() == at::kStrided, kFullyShardOp, group_, "parameter '", name,
                     "' is not a dense tensor");
      COMMGRAD_CHECK(t.is_leaf(), kFullyShardOp, group_, "parameter '", name, "' is not a leaf tensor");
      COMMGRAD_CHECK(seen.emplace(t.unsafeGetTensorImpl(), params_.size()).second, kFullyShardOp, group_, "parameter '",
                     name,
                     "' is registered twice in the unit (a tied weight): wrap the modules that share it in one unit "
                     "and register it once");
      Param param;
      param.name = name;
      param.owner = item.value().get();
      param.key = p.key();
      param.compute = t;
      param.numel = t.numel();
      param.requires_grad = t.requires_grad();
      params_.push_back(std::move(param));
    }
  }
  trainable_ = 0;
  if (params_.empty()) return;  // a root whose parameters all live in inner units
  dtype_ = params_.front().compute.scalar_type();
  for (const auto& p : params_) {
    COMMGRAD_CHECK(p.compute.scalar_type() == dtype_ && p.compute.device() == params_.front().compute.device(),
                   kFullyShardOp, group_, "the parameters of a unit must share one dtype and device; '",
                   params_.front().name, "' is ", tensor_name(params_.front().compute), ", '", p.name, "' is ",
                   tensor_name(p.compute), " (wrap them in separate units)");
    if (p.requires_grad) ++trainable_;
  }
  has_frozen_ = trainable_ < params_.size();
  const auto specs = tp::shard_specs(*module);
  for (auto& p : params_) {
    const auto* spec = specs.find(p.name);
    if (spec != nullptr && spec->spec.partial_grad && spec->group.defined() && spec->group.size() > 1) {
      p.partial_group = spec->group;
    }
  }
  compute_dtype_ = options_.mixed_precision().compute_dtype(dtype_);
  reduce_dtype_ = options_.mixed_precision().reduction_dtype(dtype_);
  // Averaging over every rank holding a copy (or over average_divisor): all
  // at once before the sum in float32; in a 16-bit dtype a part before and
  // the rest after (FSDP's rule).
  const int64_t copies = group_.size() * (options_.replicate_group().defined() ? options_.replicate_group().size() : 1);
  const int64_t world = options_.average_divisor() > 0 ? options_.average_divisor() : copies;
  const bool half = reduce_dtype_ == at::kHalf || reduce_dtype_ == at::kBFloat16;
  pre_divide_ = half ? dp::predivide_factor(world) : static_cast<double>(world);
  post_divide_ = static_cast<double>(world) / pre_divide_;
}

// The same parameters on every rank (checked), then rank 0's values.
void Unit::make_equal_everywhere() {
  std::vector<dp::NamedTensor> named;
  std::vector<at::Tensor> values;
  for (const auto& p : params_) {
    named.emplace_back(p.name, p.compute);
    values.push_back(p.compute);
  }
  at::NoGradGuard no_grad;
  for (const Group& g : {group_, options_.replicate_group()}) {
    if (!g.defined()) continue;
    dp::verify_replicas(kFullyShardOp, g, named, {});
    dp::broadcast_from_first(g, values, kBroadcastCap);
  }
}

// Offsets, padding, this rank's shard and the gathered buffer.
void Unit::lay_out() {
  if (params_.empty()) {
    unsharded_ = true;
    return;
  }
  const int64_t n = group_.size();
  for (auto& p : params_) {
    p.offset = numel_;
    numel_ += p.numel;
  }
  padded_ = (numel_ + n - 1) / n * n;
  shard_numel_ = padded_ / n;
  const auto options = params_.front().compute.options().requires_grad(false);
  at::NoGradGuard no_grad;
  auto flat = at::zeros({padded_}, options.dtype(compute_dtype_));
  shard_ = at::zeros({shard_numel_}, options);
  const int64_t begin = group_.rank() * shard_numel_;
  for (auto& p : params_) {
    flat.narrow(0, p.offset, p.numel).copy_(p.compute.detach().reshape({-1}));
    const int64_t from = std::max(p.offset, begin);
    const int64_t to = std::min(p.offset + p.numel, begin + shard_numel_);
    p.length = std::max<int64_t>(0, to - from);
    p.shard_offset = p.length > 0 ? from - begin : 0;
    p.param_begin = p.length > 0 ? from - p.offset : 0;
    if (p.length > 0)
      shard_.narrow(0, p.shard_offset, p.length)
          .copy_(p.compute.detach().reshape({-1}).narrow(0, p.param_begin, p.length));
  }
  full_ = flat;
  empty_ = at::empty({0}, options.dtype(compute_dtype_));
  for (auto& p : params_) {
    p.view = alias(full_, p.offset, p.compute.sizes());
    p.compute.set_data(p.view);
  }
  unsharded_ = true;
}

// The pieces take the parameters' places in the module.
void Unit::register_pieces() {
  for (auto& p : params_) {
    p.piece = alias(shard_, p.shard_offset, {p.length});
    p.piece.set_requires_grad(p.requires_grad);
    ParameterRegistry::of(*p.owner)[p.key] = p.piece;
  }
}

void Unit::check_not_replaced() const {
  for (const auto& p : params_) {
    const auto* now = p.owner->named_parameters(/*recurse=*/false).find(p.key);
    const bool same =
        now != nullptr && now->is_same(p.piece) && p.piece.is_alias_of(shard_) && p.piece.scalar_type() == dtype_;
    COMMGRAD_CHECK(same, kFullyShardOp, group_, "parameter '", p.name,
                   "' was replaced after fully_shard (its piece is no longer registered, or it no longer "
                   "holds the shard: to(), set_data() or a load into the module); do that before sharding it");
  }
}

// ~~~ Storage ~~~

void Unit::start_gather(bool prefetch) {
  if (unsharded_ || gather_.defined() || params_.empty()) return;
  at::NoGradGuard no_grad;
  gather_ = ops::raw::all_gather(shard_.to(compute_dtype_), ops::AllGatherOptions().dim(0), group_);
  ++tree_->current.all_gathers;
  if (prefetch) ++tree_->current.prefetched;
}

void Unit::drop_gather() {
  if (!gather_.defined()) return;
  gather_.wait();
  gather_ = ops::raw::Pending();
}

void Unit::unshard() {
  if (unsharded_ || params_.empty()) return;
  start_gather(/*prefetch=*/false);
  at::Tensor gathered = gather_.wait();
  gather_ = ops::raw::Pending();
  adopt(std::move(gathered));
  for (auto& p : params_) p.compute.set_data(p.view);
  unsharded_ = true;
}

void Unit::reshard() {
  if (!unsharded_ || params_.empty()) return;
  for (auto& p : params_) p.compute.set_data(empty_);
  free_storage();
  unsharded_ = false;
}

// Gives full_'s StorageImpl the gathered values: the result's own allocation
// when nothing else refers to it, else a new one and a copy.
void Unit::adopt(at::Tensor gathered) {
  auto* target = full_.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(padded_) * full_.element_size();
  auto storage = gathered.storage();
  // Only a plain allocation nobody else holds (not a transport's buffer, not the shard).
  const bool own = gathered.is_contiguous() && gathered.storage_offset() == 0 && storage.nbytes() == bytes &&
                   storage.use_count() == 2 && storage.allocator() != nullptr && !gathered.is_alias_of(shard_) &&
                   gathered.scalar_type() == compute_dtype_;
  if (own) {
    auto* source = storage.unsafeGetStorageImpl();
    target->set_data_ptr(source->set_data_ptr(at::DataPtr(nullptr, gathered.device())));
    source->set_nbytes(0);
    target->set_nbytes(bytes);
    return;
  }
  target->set_data_ptr(c10::GetAllocator(full_.device().type())->allocate(bytes));
  target->set_nbytes(bytes);
  at::NoGradGuard no_grad;
  full_.copy_(gathered.reshape({-1}));
}

void Unit::free_storage() {
  auto* impl = full_.storage().unsafeGetStorageImpl();
  impl->set_data_ptr(at::DataPtr(nullptr, full_.device()));
  impl->set_nbytes(0);
}

// ~~~ Forward ~~~

void Unit::before_forward() {
  Tree& t = *tree_;
  check_tripwires();
  if (t.depth == 0) {
    ++t.forward_id;
    check_not_replaced();
  }
  COMMGRAD_CHECK(last_forward_id_ != t.forward_id, kFullyShardOp, group_, "a module (",
                 module_.expired() ? std::string("?") : module_.lock()->name(),
                 ") was called twice in one forward (a unit runs once per forward; wrap the shared part in a unit "
                 "of its own or call it once)");
  last_forward_id_ = t.forward_id;
  if (!in_order_) {
    t.order.push_back(this);
    in_order_ = true;
  }
  unshard();  // a failed gather throws before the call counts as open
  ++t.depth;
  // Prefetch the unit that ran after this one in the last step.
  auto it = std::find(t.last_order.begin(), t.last_order.end(), this);
  if (it != t.last_order.end() && it + 1 != t.last_order.end()) (*(it + 1))->start_gather(/*prefetch=*/true);
}

std::vector<at::Tensor> Unit::after_forward(std::vector<at::Tensor> outputs) {
  Tree& t = *tree_;
  --t.depth;
  const bool outermost = t.depth == 0;
  const auto& output_dtype = options_.mixed_precision().output_dtype();
  if (outermost && output_dtype) {
    for (auto& o : outputs) {
      if (o.defined() && at::isFloatingType(o.scalar_type())) o = o.to(*output_dtype);
    }
  }
  const bool grad = at::GradMode::is_enabled();
  if (grad) route_through_pre_backward(*this, outputs);
  if (!grad || (options_.reshard_after_forward() && !is_root())) reshard();
  if (outermost) {
    // Forward prefetches nobody used must not survive into a step.
    for (Unit* u : t.units) {
      if (!u->unsharded_) u->drop_gather();
    }
  }
  return outputs;
}

void Unit::abandon_forward() noexcept {
  try {
    --tree_->depth;
    reshard();
  } catch (...) {
  }
}

at::Tensor Unit::cast_input(const at::Tensor& input) const {
  if (tree_->depth > 1 || !input.defined() || !at::isFloatingType(input.scalar_type())) return input;
  if (!options_.mixed_precision().param_dtype() || input.scalar_type() == compute_dtype_) return input;
  return input.to(compute_dtype_);
}

// ~~~ Inspection ~~~

UnitInfo Unit::info(const std::string& name) const {
  UnitInfo out;
  out.module = name;
  out.numel = numel_;
  out.padded_numel = padded_;
  out.shard_numel = shard_numel_;
  for (const auto& p : params_) {
    if (p.length > 0) out.segments.push_back({p.name, p.param_begin, p.shard_offset, p.length, p.view.sizes().vec()});
  }
  return out;
}

int64_t Unit::parameter_bytes() const {
  if (params_.empty()) return 0;
  const int64_t shard = shard_.numel() * static_cast<int64_t>(shard_.element_size());
  return shard + static_cast<int64_t>(full_.storage().nbytes());
}

int64_t Unit::gradient_bytes() const {
  int64_t bytes = 0;
  std::vector<const void*> counted;
  auto add = [&](const at::Tensor& g) {
    if (!g.defined()) return;
    const void* storage = g.storage().unsafeGetStorageImpl();
    if (std::find(counted.begin(), counted.end(), storage) != counted.end()) return;
    counted.push_back(storage);
    bytes += static_cast<int64_t>(g.storage().nbytes());
  };
  for (const auto& p : params_) {
    add(p.piece.grad());
    if (!p.tripwire.defined()) add(p.compute.grad());  // a tripwire's one element is no gradient
  }
  return bytes;
}

}  // namespace commgrad::fsdp::detail
